//! One server (or the primary Sentinel names): plaintext and TLS connections, pub/sub.

use super::*;

impl RedisConn {
    /// Over TLS 1.3 a server that refuses the client's certificate says so only after the
    /// handshake, in an alert the client reads: one `PING` on a raw TLS stream reads it, so a
    /// missing or unaccepted client certificate is told apart from a server that is down.
    pub(super) async fn probe_tls(&self) -> Result<(), Failure> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (host, port) = match &self.inner.source {
            Source::Tls { host, port, .. } => (host.clone(), *port),
            Source::Sentinel { tls: true, .. } => {
                let client = self.sentinel_client().await?;
                match client.get_connection_info().addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
                    _ => return Ok(()),
                }
            }
            _ => return Ok(()),
        };
        let mut stream = self.tls_stream(&host, port).await?;
        let refused = |e: std::io::Error| {
            if e.get_ref().is_some_and(|i| i.is::<rustls::Error>()) {
                Failure::Refused(io_error(&format!("TLS: {e} (check --redis-cert and --redis-key)")))
            } else {
                Failure::Unreachable(RedisError::from(e))
            }
        };
        stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.map_err(refused)?;
        stream.flush().await.map_err(refused)?;
        let mut reply = [0u8; 64];
        match tokio::time::timeout(self.inner.connect_timeout, stream.read(&mut reply)).await {
            Ok(Ok(0)) => Err(Failure::Refused(io_error(
                "Redis closed the connection after the TLS handshake (does it require a client certificate? --redis-cert, --redis-key)",
            ))),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(refused(e)),
            Err(_) => Err(Failure::Unreachable(io_error("no answer to PING over TLS"))),
        }
    }
}

impl RedisConn {
    /// Opens a new connection to the one server, or the primary Sentinel names.
    pub(super) async fn connect_single(&self) -> Result<MultiplexedConnection, Failure> {
        let config = &self.inner.config;
        match &self.inner.source {
            Source::Direct(info) => {
                let info = info
                    .clone()
                    .set_redis_settings(self.credentials(info.redis_settings())?);
                let client = Client::open(info).map_err(Failure::Refused)?;
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(Failure::of)
            }
            Source::Tls { host, port, info } => self.connect_tls(host, *port, info).await,
            Source::Sentinel { tls: false, .. } => {
                let client = self.sentinel_client().await?;
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(Failure::of)
            }
            Source::Sentinel { tls: true, .. } => {
                let client = self.sentinel_client().await?;
                let info = client.get_connection_info();
                match info.addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => {
                        self.connect_tls(host, *port, info.redis_settings()).await
                    }
                    _ => Err(Failure::Unreachable(io_error("Sentinel named no TLS address"))),
                }
            }
            Source::Cluster { .. } => Err(Failure::Refused(io_error("a cluster has no single server"))),
        }
    }
}

impl RedisConn {
    pub(super) async fn connect_tls(
        &self,
        host: &str,
        port: u16,
        info: &RedisConnectionInfo,
    ) -> Result<MultiplexedConnection, Failure> {
        let stream = self.tls_stream(host, port).await?;
        let info = self.credentials(info)?;
        let handshake = MultiplexedConnection::new_with_config(&info, stream, self.inner.config.clone());
        let (conn, driver) = match tokio::time::timeout(self.inner.connect_timeout, handshake).await {
            Ok(r) => r.map_err(Failure::of)?,
            Err(_) => return Err(Failure::Unreachable(io_error("no answer to the connection handshake"))),
        };
        tokio::spawn(driver);
        Ok(conn)
    }
}

impl RedisConn {
    pub(super) async fn tls_stream(
        &self,
        host: &str,
        port: u16,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, Failure> {
        let Some(tls) = &self.inner.tls else {
            return Err(Failure::Refused(io_error("no TLS configuration")));
        };
        tls.connect(host, port, self.inner.connect_timeout).await.map_err(|e| {
            let refused = matches!(&e, ConnectError::Handshake { source, .. } if source.get_ref().is_some_and(|i| i.is::<rustls::Error>()));
            let error = io_error(&e.to_string());
            if refused {
                Failure::Refused(error)
            } else {
                Failure::Unreachable(error)
            }
        })
    }
}

impl RedisConn {
    /// The connection's credentials: the URL's, with `--redis-username` and the password
    /// file (read now, so a rotated Secret is used by the next connection) over them.
    pub(super) fn credentials(&self, base: &RedisConnectionInfo) -> Result<RedisConnectionInfo, Failure> {
        // No `CLIENT SETINFO` at connect: one command fewer for the ACL to allow.
        let mut info = base.clone().set_skip_set_lib_name();
        if let Some(user) = &self.inner.options.username {
            info = info.set_username(user);
        }
        if let Some(path) = &self.inner.options.password_file {
            let pw = read_password(path).map_err(|e| Failure::Refused(io_error(&e)))?;
            info = info.set_password(pw);
        }
        Ok(info)
    }
}

impl RedisConn {
    /// A pub/sub connection to the current primary (its own connection, same TLS and
    /// credentials).
    pub async fn pubsub(&self) -> Result<PubSub, RedisError> {
        let (host, port, info) = match &self.inner.source {
            Source::Direct(info) => {
                let info = info
                    .clone()
                    .set_redis_settings(self.credentials(info.redis_settings()).map_err(Failure::into_error)?);
                return Client::open(info)?.get_async_pubsub().await;
            }
            Source::Tls { host, port, info } => (host.clone(), *port, info.clone()),
            Source::Sentinel { tls, .. } => {
                let client = self.sentinel_client().await.map_err(Failure::into_error)?;
                if !*tls {
                    return client.get_async_pubsub().await;
                }
                match client.get_connection_info().addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => (
                        host.clone(),
                        *port,
                        client.get_connection_info().redis_settings().clone(),
                    ),
                    _ => return Err(io_error("Sentinel named no TLS address")),
                }
            }
            Source::Cluster { .. } => return Err(io_error("a cluster uses sharded pub/sub (cluster_pubsub)")),
        };
        let stream = self.tls_stream(&host, port).await.map_err(Failure::into_error)?;
        let info = self.credentials(&info).map_err(Failure::into_error)?;
        PubSub::new(&info, stream).await
    }
}

//! Sentinel: the client that names the current primary, plaintext or TLS.

use super::*;

impl RedisConn {
    /// The client for the primary Sentinel names now (rebuilt first when the TLS files changed).
    pub(super) async fn sentinel_client(&self) -> Result<Client, Failure> {
        let Source::Sentinel {
            client,
            spec,
            tls,
            stale,
            ..
        } = &self.inner.source
        else {
            return Err(Failure::Refused(io_error("not a Sentinel URL")));
        };
        let mut sentinel = client.lock().await;
        if stale.swap(false, Ordering::AcqRel) {
            match build_sentinel(spec, *tls, &self.inner.options, self.inner.tls.as_ref()) {
                Ok(fresh) => *sentinel = fresh,
                Err(error) => tracing::warn!(%error, "cannot rebuild the Sentinel client with the new TLS files"),
            }
        }
        sentinel.async_get_client().await.map_err(Failure::of)
    }
}

/// A Sentinel client for `spec`: plaintext, or TLS to the Sentinels and the primary with the
/// same files.
pub(super) fn build_sentinel(
    spec: &SentinelSpec,
    tls: bool,
    options: &ConnOptions,
    files: Option<&Tls>,
) -> Result<SentinelClient, ConnError> {
    let invalid = |e: RedisError| ConnError::Setting(format!("Sentinel: {e}"));
    let password = match &options.password_file {
        Some(path) => Some(read_password(path).map_err(ConnError::Setting)?),
        None => spec.password.clone(),
    };
    let username = options.username.clone().or_else(|| spec.username.clone());
    if !tls {
        let mut info = RedisConnectionInfo::default().set_db(spec.db);
        if let Some(user) = &username {
            info = info.set_username(user);
        }
        if let Some(pass) = &password {
            info = info.set_password(pass);
        }
        let primary = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        return SentinelClient::build(
            spec.node_urls(),
            spec.primary.clone(),
            Some(primary),
            SentinelServerType::Master,
        )
        .map_err(invalid);
    }
    let nodes = spec.hosts.iter().map(|(host, port)| ConnectionAddr::TcpTls {
        host: host.clone(),
        port: *port,
        insecure: false,
        tls_params: None,
    });
    let mut builder = SentinelClientBuilder::new(nodes, spec.primary.clone(), SentinelServerType::Master)
        .map_err(invalid)?
        .set_client_to_sentinel_tls_mode(TlsMode::Secure)
        .set_client_to_redis_tls_mode(TlsMode::Secure)
        .set_client_to_redis_db(spec.db);
    if let Some(user) = &username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(pass) = &password {
        builder = builder.set_client_to_redis_password(pass);
    }
    if let Some(user) = &spec.sentinel_username {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(pass) = &spec.sentinel_password {
        builder = builder.set_client_to_sentinel_password(pass);
    }
    if let Some(certs) = files
        .map(Tls::certificates)
        .transpose()
        .map_err(|e| ConnError::Setting(e.to_string()))?
        .flatten()
    {
        builder = builder
            .set_client_to_sentinel_certificates(certs.clone())
            .set_client_to_redis_certificates(certs);
    }
    builder.build().map_err(invalid)
}

//! TLS to Redis: the trust roots (the system's, or `--redis-ca`), an optional client
//! certificate for mutual TLS, the name the server's certificate is checked against, and the
//! files reloaded when they change (new connections use the new files; connections already
//! open keep serving the commands in flight on them).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Where the TLS settings come from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM trust roots; the system's roots when `None`.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain and key, for mutual TLS.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the host connected to
    /// (connecting by IP address).
    pub server_name: Option<String>,
}

/// A TLS setting that cannot be used: a file missing or unreadable, no certificate in it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Redis TLS: {0}")]
pub struct TlsError(pub String);

/// Why a TLS connection was not made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server could not be reached (TCP).
    #[error("cannot reach {addr}: {source}")]
    Unreachable { addr: String, source: std::io::Error },
    /// The TLS handshake failed: the server's certificate is not trusted or not for this name,
    /// or the server refused the client certificate.
    #[error("TLS handshake with {addr} (server name {name:?}) failed: {source}")]
    Handshake {
        addr: String,
        name: String,
        source: std::io::Error,
    },
}

/// Builds TLS connections to Redis with the current files.
pub struct Tls {
    files: TlsFiles,
    state: RwLock<Loaded>,
}

struct Loaded {
    stamp: Vec<Option<(SystemTime, u64)>>,
    config: Arc<ClientConfig>,
}

impl Tls {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        if files.cert.is_some() != files.key.is_some() {
            return Err(TlsError("--redis-cert and --redis-key go together".into()));
        }
        if let Some(name) = &files.server_name {
            ServerName::try_from(name.clone()).map_err(|_| {
                TlsError(format!(
                    "--redis-tls-server-name {name:?} is not a DNS name or IP address"
                ))
            })?;
        }
        let loaded = Loaded {
            stamp: stamp(&files),
            config: Arc::new(build_config(&files)?),
        };
        Ok(Self {
            files,
            state: RwLock::new(loaded),
        })
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Rebuilds the configuration when a file changed (size or modification time). Returns
    /// whether it did; on an error (a file half-written) the last good configuration stays,
    /// and the error is returned once for that change (the next change is tried again).
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let now = stamp(&self.files);
        let changed = self.state.read().map(|s| s.stamp != now).unwrap_or(true);
        if !changed {
            return Ok(false);
        }
        let built = build_config(&self.files);
        if let Ok(mut s) = self.state.write() {
            s.stamp = now;
            if let Ok(config) = &built {
                s.config = Arc::new(config.clone());
            }
        }
        built.map(|_| true)
    }

    fn config(&self) -> Option<Arc<ClientConfig>> {
        self.state.read().ok().map(|s| s.config.clone())
    }

    /// The name checked against the server's certificate when connecting to `host`.
    pub fn server_name(&self, host: &str) -> String {
        self.files.server_name.clone().unwrap_or_else(|| host.to_owned())
    }

    /// A TLS stream to `host:port`, within `timeout` for each of the TCP connect and the handshake.
    pub async fn connect(
        &self,
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<TlsStream<TcpStream>, ConnectError> {
        let addr = format!("{}:{port}", bracket(host));
        let tcp = match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => return Err(ConnectError::Unreachable { addr, source }),
            Err(_) => {
                return Err(ConnectError::Unreachable {
                    addr,
                    source: std::io::ErrorKind::TimedOut.into(),
                })
            }
        };
        let _ = tcp.set_nodelay(true);
        let name = self.server_name(host);
        let handshake_error = |source: std::io::Error| ConnectError::Handshake {
            addr: addr.clone(),
            name: name.clone(),
            source,
        };
        let server_name = ServerName::try_from(name.clone())
            .map_err(|e| handshake_error(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
        let config = self
            .config()
            .ok_or_else(|| handshake_error(std::io::Error::other("TLS configuration unavailable")))?;
        match tokio::time::timeout(timeout, TlsConnector::from(config).connect(server_name, tcp)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(handshake_error(e)),
            Err(_) => Err(handshake_error(std::io::ErrorKind::TimedOut.into())),
        }
    }

    /// The same files for redis-rs's own TLS (the connections to Sentinels).
    pub fn certificates(&self) -> Result<Option<redis::TlsCertificates>, TlsError> {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| TlsError(format!("cannot read {}: {e}", p.display())));
        let root_cert = self.files.ca.as_ref().map(read).transpose()?;
        let client_tls = match (&self.files.cert, &self.files.key) {
            (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
                client_cert: read(c)?,
                client_key: read(k)?,
            }),
            _ => None,
        };
        Ok((root_cert.is_some() || client_tls.is_some()).then_some(redis::TlsCertificates { client_tls, root_cert }))
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

fn stamp(files: &TlsFiles) -> Vec<Option<(SystemTime, u64)>> {
    [&files.ca, &files.cert, &files.key]
        .into_iter()
        .flatten()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

fn build_config(files: &TlsFiles) -> Result<ClientConfig, TlsError> {
    let roots = match &files.ca {
        Some(path) => {
            let pem =
                std::fs::read(path).map_err(|e| TlsError(format!("cannot read --redis-ca {}: {e}", path.display())))?;
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| TlsError(format!("--redis-ca {}: {e}", path.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| TlsError(format!("--redis-ca {}: {e}", path.display())))?;
            }
            if roots.is_empty() {
                return Err(TlsError(format!("--redis-ca {} holds no certificate", path.display())));
            }
            roots
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                // Every handshake then fails with an unknown issuer, which names the cause.
                tracing::warn!("no trust roots found on this system: give the Redis server's CA with --redis-ca");
            }
            roots
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_root_certificates(roots);
    match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            let chain_pem = std::fs::read(cert)
                .map_err(|e| TlsError(format!("cannot read --redis-cert {}: {e}", cert.display())))?;
            let chain = CertificateDer::pem_slice_iter(&chain_pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TlsError(format!("--redis-cert {}: {e}", cert.display())))?;
            if chain.is_empty() {
                return Err(TlsError(format!(
                    "--redis-cert {} holds no certificate",
                    cert.display()
                )));
            }
            let key_pem =
                std::fs::read(key).map_err(|e| TlsError(format!("cannot read --redis-key {}: {e}", key.display())))?;
            let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
                .map_err(|e| TlsError(format!("--redis-key {}: {e}", key.display())))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| TlsError(format!("--redis-cert/--redis-key: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("turnlock-redis-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn unusable_files_are_named_and_a_good_set_loads() {
        let d = dir();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("certificate");
        let (pem, key_pem) = (made.cert.pem(), made.signing_key.serialize_pem());
        let (ca, cert, key, empty) = (
            d.join("ca.crt"),
            d.join("tls.crt"),
            d.join("tls.key"),
            d.join("empty.crt"),
        );
        std::fs::write(&ca, &pem).expect("write");
        std::fs::write(&cert, &pem).expect("write");
        std::fs::write(&key, &key_pem).expect("write");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let load = |files: TlsFiles| Tls::load(files).err().map(|e| e.to_string());
        let missing = d.join("missing.crt");
        for (files, says) in [
            (
                TlsFiles {
                    ca: Some(missing.clone()),
                    ..TlsFiles::default()
                },
                missing.display().to_string(),
            ),
            (
                TlsFiles {
                    ca: Some(empty.clone()),
                    ..TlsFiles::default()
                },
                "holds no certificate".into(),
            ),
            (
                TlsFiles {
                    ca: Some(ca.clone()),
                    cert: Some(cert.clone()),
                    ..TlsFiles::default()
                },
                "go together".into(),
            ),
            (
                TlsFiles {
                    ca: Some(ca.clone()),
                    server_name: Some("not a name!".into()),
                    ..TlsFiles::default()
                },
                "--redis-tls-server-name".into(),
            ),
        ] {
            let e = load(files).expect("refused");
            assert!(e.contains(&says), "{e:?} lacks {says:?}");
        }
        let tls = Tls::load(TlsFiles {
            ca: Some(ca.clone()),
            cert: Some(cert),
            key: Some(key),
            server_name: Some("redis.internal".into()),
        })
        .expect("loads");
        assert_eq!(tls.server_name("10.0.0.5"), "redis.internal");
        assert!(!tls.reload_if_changed().expect("unchanged"));
        std::fs::write(&ca, format!("{pem}{pem}")).expect("rewrite");
        assert!(tls.reload_if_changed().expect("reloaded"), "a changed file is reloaded");
        std::fs::write(&ca, "half-written").expect("rewrite");
        assert!(tls.reload_if_changed().is_err(), "a broken file is not taken");
        assert!(
            !tls.reload_if_changed().expect("said once"),
            "the same broken file is reported once"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}

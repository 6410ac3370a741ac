//! Certificates made in the test (a CA, server and client certificates signed by it) and a
//! real `redis-server` serving TLS with them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::{free_port, wait_for_port, RedisServer};

/// A test CA; it issues certificates as PEM files in `dir`.
pub struct TestCa {
    pub dir: PathBuf,
    pub name: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    pub fn new(dir: &Path, name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.distinguished_name = dn(name);
        let cert = params.self_signed(&key).expect("CA certificate");
        std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).expect("write CA");
        Self {
            dir: dir.to_owned(),
            name: name.to_owned(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA certificate's file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join(format!("{}.crt", self.name))
    }

    /// A certificate for `names` (DNS names or IP addresses) usable by a server and a client:
    /// its (cert, key) files, named `<file>.crt` / `<file>.key`.
    pub fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*n).to_owned().try_into().expect("DNS name")),
            })
            .collect();
        params.distinguished_name = dn(names.first().copied().unwrap_or(file));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let (c, k) = (
            self.dir.join(format!("{file}.crt")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write cert");
        std::fs::write(&k, key.serialize_pem()).expect("write key");
        (c, k)
    }
}

fn dn(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// A `redis-server` with a TLS port (certificate for `localhost` and 127.0.0.1, signed by
/// `ca`) besides its plaintext port (kept for the test's own commands).
pub struct TlsRedis {
    pub server: RedisServer,
    pub tls_port: u16,
}

impl TlsRedis {
    /// `auth_clients`: whether Redis asks clients for a certificate signed by `ca`.
    pub fn start(ca: &TestCa, auth_clients: bool, extra: &[&str]) -> Self {
        Self::start_on(free_port(), ca, auth_clients, extra)
    }

    pub fn start_on(tls_port: u16, ca: &TestCa, auth_clients: bool, extra: &[&str]) -> Self {
        Self::start_named(tls_port, ca, &["localhost", "127.0.0.1"], auth_clients, extra)
    }

    /// With a certificate for `names` only.
    pub fn start_named(tls_port: u16, ca: &TestCa, names: &[&str], auth_clients: bool, extra: &[&str]) -> Self {
        let (cert, key) = ca.issue("redis-server", names);
        let port = tls_port.to_string();
        let (cert, key, ca_file) = (path(&cert), path(&key), path(&ca.ca_file()));
        let mut args = vec![
            "--tls-port",
            &port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca_file,
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ];
        args.extend_from_slice(extra);
        let server = RedisServer::start_with(&args);
        wait_for_port(tls_port, Duration::from_secs(10));
        Self { server, tls_port }
    }

    /// `rediss://127.0.0.1:<tls port>`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }
}

pub fn path(p: &Path) -> String {
    p.to_str().expect("utf-8 path").to_owned()
}

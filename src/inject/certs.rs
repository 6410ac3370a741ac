//! `turnlock inject certs`: a private CA and the webhook's serving certificate, for kind and
//! other local clusters. Real clusters use the cert-manager `Certificate` in `k8s/`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

use crate::config::ConfigError;

#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    /// Directory the files are written to: ca.crt, tls.crt, tls.key.
    #[arg(long, default_value = ".")]
    pub out_dir: PathBuf,
    /// The webhook's Service name.
    #[arg(long, default_value = "turnlock-injector")]
    pub service: String,
    /// The webhook's namespace.
    #[arg(long, default_value = "turnlock-system")]
    pub namespace: String,
    /// Extra DNS names or IP addresses for the serving certificate (repeatable).
    #[arg(long = "san")]
    pub extra_sans: Vec<String>,
    /// Validity of both certificates, in days.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

/// The generated files, PEM-encoded.
pub struct Generated {
    pub ca_cert: String,
    pub cert: String,
    pub key: String,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot generate certificates: {0}")]
pub struct CertError(#[from] rcgen::Error);

/// The DNS names the API server uses to reach the webhook's Service.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Generates a CA and a serving certificate for `names` (DNS names or IP addresses).
pub fn generate(names: &[String], days: u32) -> Result<Generated, CertError> {
    let now = OffsetDateTime::now_utc();
    let not_before = now - Duration::from_secs(3600);
    let not_after = now + Duration::from_secs(u64::from(days) * 86_400);

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.distinguished_name = name("turnlock injector CA");
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key)?;

    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(Vec::<String>::new())?;
    leaf.subject_alt_names = names
        .iter()
        .map(|n| match n.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName),
        })
        .collect::<Result<_, _>>()?;
    leaf.distinguished_name = name(names.first().map(String::as_str).unwrap_or("turnlock-injector"));
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.not_before = not_before;
    leaf.not_after = not_after;
    let issuer = Issuer::new(ca, ca_key);
    let cert = leaf.signed_by(&key, &issuer)?;

    Ok(Generated {
        ca_cert: ca_cert.pem(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// Writes the files and prints how to use them.
pub fn run(args: &CertsArgs) -> Result<(), ConfigError> {
    let mut names = service_names(&args.service, &args.namespace);
    names.extend(args.extra_sans.iter().cloned());
    let generated = generate(&names, args.days).map_err(|e| ConfigError(e.to_string()))?;
    std::fs::create_dir_all(&args.out_dir)
        .map_err(|e| ConfigError(format!("cannot create {}: {e}", args.out_dir.display())))?;
    write(&args.out_dir.join("ca.crt"), &generated.ca_cert, false)?;
    write(&args.out_dir.join("tls.crt"), &generated.cert, false)?;
    write(&args.out_dir.join("tls.key"), &generated.key, true)?;
    println!(
        "wrote ca.crt, tls.crt and tls.key to {dir}\n\
         kubectl -n {ns} create secret tls turnlock-injector-tls --cert={dir}/tls.crt --key={dir}/tls.key\n\
         then set the webhooks' caBundle to: base64 -w0 {dir}/ca.crt",
        dir = args.out_dir.display(),
        ns = args.namespace,
    );
    Ok(())
}

fn write(path: &Path, contents: &str, private: bool) -> Result<(), ConfigError> {
    let err = |e: std::io::Error| ConfigError(format!("cannot write {}: {e}", path.display()));
    std::fs::write(path, contents).map_err(err)?;
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = private;
    Ok(())
}

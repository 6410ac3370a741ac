//! TLS to the store (and to STS): rustls with the system's roots and the given CA.

/// TLS to the store: the system's roots, plus the CA certificates of `ca` (PEM).
pub(super) fn tls_config(ca: Option<&std::path::Path>) -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is left out, as other clients do.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca {
        let pem = std::fs::read(path).map_err(|e| format!("cannot read --upstream-ca {}: {e}", path.display()))?;
        let mut added = 0;
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            added += 1;
        }
        if added == 0 {
            return Err(format!("--upstream-ca {} holds no PEM certificate", path.display()));
        }
    }
    if roots.is_empty() {
        return Err(
            "no CA certificates to verify the store with: install the system's (ca-certificates) or give --upstream-ca"
                .into(),
        );
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(std::sync::Arc::new(config))
}

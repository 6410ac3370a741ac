//! Building one proxy (with its own write pipeline) per store.

use std::time::Duration;

use super::{Limits, Pipeline, PipelineSettings, Proxy};
use crate::lock::Locks;
use crate::metrics::Metrics;
use crate::records::Records;
use crate::routes::Routes;
use crate::session::Keys;
use crate::upstream::{PoolSettings, Upstream};

/// Builds a proxy (with its own write pipeline) for one store; the lock backend, records and
/// metrics are shared, so writers of one session are serialized whichever store they address.
pub struct ProxyFactory {
    pub routes: Routes,
    pub locks: Locks,
    pub records: Records,
    pub keys: Keys,
    pub metrics: Metrics,
    pub settings: PipelineSettings,
    pub upstream_timeout: Duration,
    pub pool: PoolSettings,
    pub max_body: Limits,
    /// CA certificates for an `https://` store, besides the system's roots.
    pub upstream_ca: Option<std::path::PathBuf>,
}

impl ProxyFactory {
    pub(crate) fn upstream(&self, url: &str) -> Result<Upstream, String> {
        let upstream = Upstream::with_tls(
            url,
            self.upstream_timeout,
            self.pool,
            self.metrics.clone(),
            self.upstream_ca.as_deref(),
        )?;
        Ok(match self.routes.signing() {
            Some(s) => upstream.with_signer(crate::upstream::Signer::from_env(&s.region, &s.service)?),
            None => upstream,
        })
    }

    pub(crate) fn proxy(&self, upstream: Upstream) -> Proxy {
        self.proxy_with_keys(upstream, self.keys.clone())
    }

    /// The proxy for one of several stores (transparent mode): its documents' keys are its own.
    pub(crate) fn proxy_for_store(&self, upstream: Upstream, store: &str) -> Proxy {
        self.proxy_with_keys(upstream, self.keys.for_store(store))
    }

    fn proxy_with_keys(&self, upstream: Upstream, keys: Keys) -> Proxy {
        let pipeline = Pipeline::new(
            self.locks.clone(),
            self.records.clone(),
            upstream.clone(),
            keys,
            self.metrics.clone(),
            self.settings.clone(),
        );
        Proxy::new(
            self.routes.clone(),
            upstream,
            pipeline,
            self.metrics.clone(),
            self.max_body,
        )
    }
}

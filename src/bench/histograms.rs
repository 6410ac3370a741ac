//! The means the hot session reads from the proxies' histograms, over one phase.

/// A histogram's sum and count.
#[derive(Clone, Copy, Default)]
pub(super) struct SumCount {
    sum: f64,
    count: f64,
}

impl SumCount {
    pub(super) fn add(&mut self, sum: f64, count: f64) {
        self.sum += sum;
        self.count += count;
    }

    pub(super) fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    pub(super) fn since(&self, before: &SumCount) -> SumCount {
        SumCount {
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }
}

#[derive(Clone, Copy, Default)]
pub(super) struct Histograms {
    pub(super) batch: SumCount,
    pub(super) hold: SumCount,
    pub(super) wait: SumCount,
    pub(super) get: SumCount,
    pub(super) put: SumCount,
}

impl Histograms {
    pub(super) fn since(&self, before: &Histograms) -> Histograms {
        Histograms {
            batch: self.batch.since(&before.batch),
            hold: self.hold.since(&before.hold),
            wait: self.wait.since(&before.wait),
            get: self.get.since(&before.get),
            put: self.put.since(&before.put),
        }
    }
}

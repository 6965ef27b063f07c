//! An expert supplier watched from outside: what `les bench` measures without
//! the forward pass or the supplier knowing.
//!
//! [`Watched`] forwards every [`Experts`] call to the supplier it wraps and
//! first shows each layer's routing to a [`Watcher`], which may read the
//! supplier's counters then. A pair of watchers watches together.

use les_core::model::forward::{Experts, Handout, Residency, Step};

/// Sees each layer's routing before the supplier `X` does.
pub trait Watcher<X> {
    /// `layer` routed to `routing`; `supplier` has not begun the layer yet.
    fn begin_layer(&mut self, supplier: &X, layer: usize, routing: &[u16]);
}

impl<X, A: Watcher<X>, B: Watcher<X>> Watcher<X> for (A, B) {
    fn begin_layer(&mut self, supplier: &X, layer: usize, routing: &[u16]) {
        self.0.begin_layer(supplier, layer, routing);
        self.1.begin_layer(supplier, layer, routing);
    }
}

/// A supplier and what watches it.
pub struct Watched<'a, X, W> {
    /// The supplier.
    pub inner: &'a mut X,
    /// What watches it.
    pub watcher: W,
}

impl<'a, X, W> Watched<'a, X, W> {
    /// `inner`, watched by `watcher` from now on.
    pub fn new(inner: &'a mut X, watcher: W) -> Self {
        Watched { inner, watcher }
    }
}

impl<X: Experts, W: Watcher<X>> Experts for Watched<'_, X, W> {
    type Error = X::Error;
    fn begin_token(&mut self) {
        self.inner.begin_token()
    }
    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), X::Error> {
        self.watcher.begin_layer(self.inner, layer, routing);
        self.inner.begin_layer(layer, routing)
    }
    fn max_picks(&self, layer: usize) -> usize {
        self.inner.max_picks(layer)
    }
    fn router_logits(&mut self, layer: usize, logits: &[f32]) {
        self.inner.router_logits(layer, logits)
    }
    fn wants_predictions(&self) -> bool {
        self.inner.wants_predictions()
    }
    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), X::Error> {
        self.inner.prefetch(layer, predicted)
    }
    fn prefetch_known(&mut self, layer: usize, experts: &[u16]) -> Result<(), X::Error> {
        self.inner.prefetch_known(layer, experts)
    }
    fn residency(&self, layer: usize, expert: u16) -> Residency {
        self.inner.residency(layer, expert)
    }
    fn next(&mut self) -> Result<Option<Handout<'_>>, X::Error> {
        self.inner.next()
    }
    fn try_next(&mut self) -> Result<Step<'_>, X::Error> {
        self.inner.try_next()
    }
    fn next_part(&mut self, block: bool) -> Result<Step<'_>, X::Error> {
        self.inner.next_part(block)
    }
    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), X::Error> {
        self.inner.finish(index, checksum)
    }
}

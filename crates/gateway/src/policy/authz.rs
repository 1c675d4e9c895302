//! Authorization: the route's `allow` list (consumers and plans) decides who may call it.

use crate::exchange::Refusal;
use crate::snapshot::{Route, Snapshot};

/// Refuses with 403 a consumer the route does not allow.
pub fn authorize(snap: &Snapshot, route: &Route, consumer: usize) -> Result<(), Refusal> {
    if snap.allowed(route, consumer) {
        Ok(())
    } else {
        Err(Refusal::Forbidden)
    }
}

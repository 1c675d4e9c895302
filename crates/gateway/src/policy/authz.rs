//! Authorization: the route's `allow` list (consumers and plans) decides who may call it.

use crate::response::Refusal;
use crate::snapshot::Route;

/// Refuses with 403 a consumer the route does not allow.
pub fn authorize(route: &Route, consumer: usize) -> Result<(), Refusal> {
    if route.allowed.get(consumer).copied().unwrap_or(false) {
        Ok(())
    } else {
        Err(Refusal::Forbidden)
    }
}

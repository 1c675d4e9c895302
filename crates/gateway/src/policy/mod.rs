//! The policies, in the one order they run. Each is a small module with one entry point
//! that either lets the request go on or answers it (a [`Refusal`], or for a CORS
//! preflight a ready answer):
//!
//! 1. [`method`]: method filter (part of route selection, since routes may split by method) → 405
//! 2. [`cors`]: CORS preflight, answered here and never forwarded → 204 / 403
//! 3. [`auth`]: API key from header or query, bearer token ([`jwt`]) or client
//!    certificate → consumer, credential removed → 401
//! 4. [`authz`]: may this consumer call this route → 403
//! 5. [`limits`]: every limit of the consumer, checked together → 429 (503 if a shared
//!    limit's store is down and the cluster fails closed)

pub mod auth;
pub mod authz;
pub mod cors;
pub mod jwt;
pub mod limits;
pub mod method;

use crate::clock::Clock;
use crate::exchange::{Parts, Refusal};
use crate::limiter::Standing;
use crate::response::Body;
use crate::snapshot::{Route, Snapshot};
use http::{HeaderValue, Response};

/// What the policies learned about a request that goes on upstream.
#[derive(Debug, Default)]
pub struct Admitted {
    /// The consumer, by index in the snapshot.
    pub consumer: Option<usize>,
    /// The tightest limit's standing, for the RateLimit headers.
    pub standing: Option<Standing>,
    /// The consumer's plan slot: which of the route's limit sets applied.
    pub plan_slot: usize,
}

/// The result of running the policies.
pub enum Verdict {
    /// Forward the request.
    Forward(Admitted),
    /// Every policy let the request pass but a shared limit, whose lease is on its way:
    /// run [`limits::check`] again once the cluster's round lands.
    Leasing(Admitted),
    /// Answer with this (a CORS preflight).
    Answer(Box<Response<Body>>),
}

/// Runs the policies after route selection, in order. The limiter reads `clock` only when
/// the request meets a limit. `identified` is set as soon as the consumer is known, so that
/// a refusal after that (403, 429) is logged and counted under the consumer it refused.
pub fn run(
    snap: &Snapshot,
    route: &Route,
    parts: &mut Parts,
    clock: &dyn Clock,
    client_names: Option<&[Box<str>]>,
    identified: &mut Option<usize>,
) -> Result<Verdict, Refusal> {
    if let Some(answer) = cors::preflight(route, parts)? {
        return Ok(Verdict::Answer(Box::new(answer)));
    }
    let consumer = auth::authenticate(snap, route, parts, client_names, clock)?;
    *identified = consumer;
    let mut admitted = Admitted {
        consumer,
        standing: None,
        plan_slot: 0,
    };
    if let Some(c) = consumer {
        authz::authorize(snap, route, c)?;
        admitted.plan_slot = snap.counters.plan_slot(c);
        match limits::check(
            snap,
            route,
            c,
            admitted.plan_slot,
            clock,
            limits::Attempt::First,
        )? {
            limits::Limited::Admitted(s) => admitted.standing = s,
            limits::Limited::Leasing => return Ok(Verdict::Leasing(admitted)),
        }
    }
    Ok(Verdict::Forward(admitted))
}

/// Who the caller is, for a refusal decided before the policies run (a body declared
/// larger than the listener takes): the consumer its API key or client certificate names,
/// if it names one, so that the refusal is logged and counted under it. A token route's
/// caller is not looked for: a signature check, or a key set fetch for a key id not yet
/// seen, is not spent on a request refused anyway. Refuses nothing itself.
pub fn identify(
    snap: &Snapshot,
    route: &Route,
    parts: &mut Parts,
    clock: &dyn Clock,
    client_names: Option<&[Box<str>]>,
) -> Option<usize> {
    if route.jwt.is_some() {
        return None;
    }
    auth::authenticate(snap, route, parts, client_names, clock)
        .ok()
        .flatten()
}

/// Adds what the policies owe every response of an admitted request: the RateLimit headers.
pub fn decorate(route: &Route, admitted: &Admitted, headers: &mut http::HeaderMap) {
    if let Some(s) = admitted.standing {
        limits::headers(route, admitted.plan_slot, s, headers);
    }
}

/// The request's `Origin`, when the route does CORS and the origin is allowed.
pub fn cors_origin(route: &Route, parts: &Parts) -> Option<HeaderValue> {
    cors::allowed_origin(route, parts)
}

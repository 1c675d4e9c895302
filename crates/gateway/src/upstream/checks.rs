//! Active health checks: a task per upstream in use asks each target for the check path
//! and takes it out of rotation, or back in, by the answers.

use super::alt::AltClient;
use super::body::UpBody;
use super::health::first_check_delay;
use super::target::Upstream;
use http::header;
use http::uri::PathAndQuery;
use http::Request;
use std::sync::Arc;

/// Active checks of an upstream's targets.
impl Upstream {
    /// Runs active health checks while the upstream is in use (it holds no reference to
    /// itself: the task ends once every snapshot has dropped it).
    pub fn start_checks(self: &Arc<Self>) {
        let Some(active) = self.cfg.health.active.clone() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(upstream = %self.cfg.name, "no runtime: active health checks off");
            return;
        };
        let weak = Arc::downgrade(self);
        rt.spawn(async move {
            tokio::time::sleep(first_check_delay(active.interval)).await;
            let mut tick = tokio::time::interval(active.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(up) = weak.upgrade() else { return };
                up.check_all(&active).await;
            }
        });
    }

    async fn check_all(&self, active: &tollgate_config::ActiveHealth) {
        let Some(client) = self.check_client() else {
            return;
        };
        let Ok(pq) = PathAndQuery::try_from(active.path.as_str()) else {
            return;
        };
        let mut set = tokio::task::JoinSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            let (client, pq, name, host) =
                (client.clone(), pq.clone(), t.name.clone(), t.host.clone());
            let timeout = active.timeout;
            set.spawn(async move {
                let Some(uri) = client.uri(&name, &pq) else {
                    return (i, false);
                };
                let mut req = Request::new(UpBody::empty());
                *req.uri_mut() = uri;
                req.headers_mut().insert(header::HOST, host);
                let ok = matches!(
                    tokio::time::timeout(timeout, client.send(i, req, None)).await,
                    Ok(Ok((r, _))) if r.status().is_success() || r.status().is_redirection()
                );
                (i, ok)
            });
        }
        while let Some(joined) = set.join_next().await {
            let Ok((i, ok)) = joined else { continue };
            let Some(t) = self.targets.get(i) else {
                continue;
            };
            match t.health.checked(ok, active.healthy, active.unhealthy) {
                Some(true) => {
                    tracing::info!(upstream = %self.cfg.name, target = %t.name, "target healthy again (active checks)")
                }
                Some(false) => {
                    self.stats.taken_out.inc();
                    tracing::warn!(upstream = %self.cfg.name, target = %t.name, path = %active.path, "target taken out of rotation by active checks")
                }
                None => {}
            }
        }
    }

    /// The client active checks use: the upstream's own when it has one, else a new
    /// HTTP/1.1 one (checks open their own connections, apart from the request pools).
    fn check_client(&self) -> Option<AltClient> {
        if let Some(a) = &self.alt {
            return Some(a.clone());
        }
        self.upgrade_client()
    }
}

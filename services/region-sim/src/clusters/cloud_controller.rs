//! The cloud controller's work for LoadBalancer Services: it watches a cluster's objects, keeps
//! a DO load balancer for each such Service (through the world), a data-plane endpoint at its
//! address wired as the cluster's objects say, and the address on the Service's status.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use dataplane_sim::data_plane::Endpoint;
use dataplane_sim::objects::Objects;
use dataplane_sim::routing;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::{ClusterSide, EndpointSlot};
use crate::world::ServiceLb;
use crate::Shared;

/// Re-derives the cloud controller's view whenever the cluster's objects change, and every 100 ms
/// while a load balancer is not active yet (a timed transition the objects do not show). A
/// settled cluster is looked at every `Clusters::idle`, and only re-derived if its objects
/// changed since it settled (a change is normally seen at once; this is the safety net): what
/// the cloud controller derives is a function of the objects once every load balancer is
/// active, so thousands of settled clusters cost nothing.
pub(super) async fn watch_cluster(
    shared: std::sync::Weak<Shared>,
    id: String,
    side: Arc<ClusterSide>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = side.kube.subscribe();
    // The resourceVersion at which the cluster was last found settled, and whether this
    // wake-up is the idle one rather than a change.
    let mut settled_at: Option<u64> = None;
    let mut idle_wake = false;
    loop {
        let Some(s) = shared.upgrade() else { return };
        if *stop.borrow() {
            return;
        }
        let rv = side.kube.resource_version();
        let pause = if idle_wake && settled_at == Some(rv) {
            s.clusters.idle
        } else {
            settled_at = None;
            match reconcile(&s, &id, &side).await {
                Ok(true) => {
                    // Settled: nothing was written, so `rv` is still what it derived from.
                    settled_at = Some(rv);
                    s.clusters.idle
                }
                Ok(false) => Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!(error = %e, cluster_id = %id, "cloud controller pass failed");
                    Duration::from_millis(100)
                }
            }
        };
        drop(s);
        idle_wake = false;
        tokio::select! {
            _ = stop.changed() => return,
            r = changes.recv() => {
                if let Err(tokio::sync::broadcast::error::RecvError::Closed) = r {
                    return;
                }
                // Let a burst of writes (a worker applies a DI's objects at once) land, and
                // look once for all of them.
                tokio::time::sleep(Duration::from_millis(5)).await;
                use tokio::sync::broadcast::error::TryRecvError;
                while !matches!(
                    changes.try_recv(),
                    Err(TryRecvError::Empty | TryRecvError::Closed)
                ) {}
            }
            _ = tokio::time::sleep(pause) => idle_wake = true,
        }
    }
}

fn is_lb_service(o: &Value) -> bool {
    o["kind"] == "Service"
        && o["apiVersion"] == "v1"
        && o.pointer("/spec/type").and_then(Value::as_str) == Some("LoadBalancer")
        && o.pointer("/metadata/deletionTimestamp")
            .is_none_or(Value::is_null)
}

fn service_lb(o: &Value) -> ServiceLb {
    let str_map = |v: Option<&Value>| -> BTreeMap<String, String> {
        v.and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let ns = o
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_string();
    let name = o
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let uid = o
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("{ns}/{name}"));
    ServiceLb {
        namespace: ns,
        name,
        uid,
        annotations: str_map(o.pointer("/metadata/annotations")),
        ports: o
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        (
                            p["port"].as_i64().unwrap_or(0),
                            p["protocol"].as_str().unwrap_or("TCP").to_string(),
                            p["nodePort"].as_i64(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// One cloud-controller pass over a cluster. True when it is settled: every load balancer is
/// active and its Service already shows the address.
async fn reconcile(shared: &Arc<Shared>, id: &str, side: &ClusterSide) -> anyhow::Result<bool> {
    let objs = side.kube.snapshot();
    let services: Vec<&Value> = objs
        .iter()
        .map(std::sync::Arc::as_ref)
        .filter(|o| is_lb_service(o))
        .collect();
    let lbs: Vec<ServiceLb> = services.iter().map(|o| service_lb(o)).collect();
    let statuses = shared.world.lb_sync(id, &lbs);
    // Filed by namespace once for all the Services' wirings, each of which reads its own
    // namespace: a cluster holds many DIs.
    let filed = Objects::new(&objs);

    // Each load balancer's endpoint serves at the load balancer's address; endpoints for
    // services that are gone go away with their load balancer.
    let wanted: HashMap<(String, String), Ipv4Addr> = statuses
        .iter()
        .map(|st| ((st.namespace.clone(), st.name.clone()), st.ip))
        .collect();
    let front = shared.clusters.front();
    let mut publish = Vec::new();
    {
        let mut eps = side.endpoints.lock().expect("endpoints lock");
        eps.retain(|k, slot| {
            // A Service replaced under the same name has a new load balancer, at a new address.
            let keep = wanted.get(k) == Some(&slot.endpoint.ip());
            if !keep {
                slot.endpoint.shutdown();
            }
            keep
        });
        for (key, ip) in &wanted {
            if !eps.contains_key(key) {
                let ep = Endpoint::start(front, *ip, shared.model.clone(), shared.faults.clone());
                eps.insert(
                    key.clone(),
                    EndpointSlot {
                        endpoint: ep,
                        problems: Vec::new(),
                    },
                );
            }
        }
        for (svc, st) in services.iter().zip(&statuses) {
            let key = (st.namespace.clone(), st.name.clone());
            let Some(slot) = eps.get_mut(&key) else {
                continue;
            };
            let wiring = routing::wire(svc, &filed);
            let mut problems = wiring.problems;
            if let Err(e) = slot.endpoint.update(wiring.config) {
                problems.push(format!("TLS certificate rejected: {e}"));
            }
            slot.problems = problems;
            if !st.active {
                continue;
            }
            let ingress = json!([{
                "ip": st.ip.to_string(),
                "ports": [{"port": slot.endpoint.port(), "protocol": "TCP"}],
            }]);
            // Write only on change, so a settled cluster sees no writes from the cloud side.
            if svc.pointer("/status/loadBalancer/ingress") != Some(&ingress) {
                publish.push((key, ingress));
            }
        }
    }
    let settled = publish.is_empty() && statuses.iter().all(|st| st.active);
    for ((ns, name), ingress) in publish {
        side.kube.set_service_ingress(&ns, &name, ingress).await?;
    }
    Ok(settled)
}

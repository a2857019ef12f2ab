//! The simulated region's cloud state: VPCs, DOKS clusters, node pools, nodes and load balancers.
//!
//! Everything asynchronous in the real cloud (provisioning, deleting, load balancers coming up) is
//! a timestamped state here, advanced by [`World::tick`]. Side effects on the simulated Kubernetes
//! clusters (nodes appearing, disappearing, a cluster going away) are queued as [`Effect`]s and
//! applied outside the lock by whoever drives the ticks, so this module stays synchronous and
//! testable without Kubernetes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use rand::Rng;
use region_sim_base::front::Addresses;
use region_sim_base::sizes::{self, SizeInfo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

mod doks;
mod load_balancers;
mod vpcs;

/// Kubernetes version reported for clusters created with `latest` or a minor version.
pub const DEFAULT_K8S_VERSION: &str = "1.33.1-do.3";

/// Delays of the simulated asynchronous operations, in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Delays {
    /// Cluster `provisioning` → `running`.
    pub cluster_provision_ms: u64,
    /// Node `provisioning` → `running` (and a Kubernetes Node appearing).
    pub node_provision_ms: u64,
    /// Cluster, node pool and node `deleting` → gone.
    pub deletion_ms: u64,
    /// Load balancer `new` → `active` (and the Service getting its ingress address).
    pub lb_provision_ms: u64,
    /// Model server pods becoming ready (passed to the simulated Kubernetes clusters).
    pub model_load_ms: u64,
    /// Gateways getting an address (passed to the simulated Kubernetes clusters).
    pub gateway_address_ms: u64,
}

impl Default for Delays {
    fn default() -> Self {
        Self {
            cluster_provision_ms: 3000,
            node_provision_ms: 2000,
            deletion_ms: 1000,
            lb_provision_ms: 1000,
            model_load_ms: 2000,
            gateway_address_ms: 500,
        }
    }
}

impl Delays {
    /// Everything immediate: for tests that do not care about timing.
    pub fn instant() -> Self {
        Self {
            cluster_provision_ms: 0,
            node_provision_ms: 0,
            deletion_ms: 0,
            lb_provision_ms: 0,
            model_load_ms: 0,
            gateway_address_ms: 0,
        }
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Default GPU capacity per size slug, in nodes, for a fresh region.
pub fn default_capacity() -> BTreeMap<String, u32> {
    [
        ("gpu-h100x1-80gb", 8),
        ("gpu-h100x8-640gb", 2),
        ("gpu-h200x1-141gb", 8),
        ("gpu-h200x8-1128gb", 2),
        ("gpu-mi300x1-192gb", 8),
        ("gpu-mi300x8-1536gb", 2),
        ("gpu-mi325x1-256gb", 4),
        ("gpu-l40sx1-48gb", 8),
        ("gpu-4000adax1-20gb", 8),
        ("gpu-6000adax1-48gb", 8),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Why a world operation was refused; the DO API maps these to its error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorldError {
    NotFound,
    Unprocessable(String),
    Conflict(String),
}

/// A change the simulated Kubernetes side must make; produced under the world lock, applied later.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// A new cluster needs a Kubernetes API server.
    ClusterCreated {
        cluster_id: String,
        name: String,
    },
    /// Create or replace a Node object.
    UpsertNode {
        cluster_id: String,
        node: Value,
    },
    DeleteNode {
        cluster_id: String,
        name: String,
    },
    /// The cluster is gone: stop its API server and anything serving on its behalf.
    ClusterGone {
        cluster_id: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
pub struct VpcCreate {
    pub name: String,
    pub region: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub ip_range: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    pub effect: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PoolSpec {
    pub name: Option<String>,
    pub size: Option<String>,
    pub count: Option<i64>,
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub taints: Option<Vec<Taint>>,
    #[serde(default)]
    pub auto_scale: Option<bool>,
    #[serde(default)]
    pub min_nodes: Option<i64>,
    #[serde(default)]
    pub max_nodes: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ClusterCreate {
    pub name: Option<String>,
    pub region: Option<String>,
    pub version: Option<String>,
    #[serde(default)]
    pub vpc_uuid: Option<String>,
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    pub node_pools: Option<Vec<PoolSpec>>,
    #[serde(default)]
    pub maintenance_policy: Option<Value>,
    #[serde(default)]
    pub auto_upgrade: Option<bool>,
    #[serde(default)]
    pub surge_upgrade: Option<bool>,
    #[serde(default)]
    pub ha: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClusterState {
    Provisioning,
    Running,
    Deleting,
}

impl ClusterState {
    fn as_str(self) -> &'static str {
        match self {
            ClusterState::Provisioning => "provisioning",
            ClusterState::Running => "running",
            ClusterState::Deleting => "deleting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeState {
    Provisioning,
    Running,
    Deleting,
}

impl NodeState {
    fn as_str(self) -> &'static str {
        match self {
            NodeState::Provisioning => "provisioning",
            NodeState::Running => "running",
            NodeState::Deleting => "deleting",
        }
    }
}

#[derive(Debug, Clone)]
struct Vpc {
    id: String,
    /// The account the VPC belongs to; `None` for the platform's own account (the credential
    /// the simulator was started with, acting for no customer).
    account: Option<Uuid>,
    name: String,
    description: String,
    region: String,
    ip_range: String,
    default: bool,
    created_at: String,
}

#[derive(Debug, Clone)]
struct Node {
    id: String,
    name: String,
    droplet_id: String,
    state: NodeState,
    until: Instant,
    created_at: String,
    updated_at: String,
    /// Whether a Node object currently exists for it in the cluster's Kubernetes API.
    in_kube: bool,
    /// Killed through the admin API: reported NotReady until it is gone.
    killed: bool,
}

#[derive(Debug, Clone)]
struct Pool {
    id: String,
    name: String,
    size: SizeInfo,
    count: u32,
    tags: Vec<String>,
    labels: Option<BTreeMap<String, String>>,
    taints: Vec<Taint>,
    auto_scale: bool,
    min_nodes: u32,
    max_nodes: u32,
    nodes: Vec<Node>,
    deleting_until: Option<Instant>,
}

#[derive(Debug, Clone)]
struct Cluster {
    id: String,
    name: String,
    region: String,
    version: String,
    vpc_uuid: String,
    tags: Vec<String>,
    state: ClusterState,
    until: Instant,
    created_at: String,
    updated_at: String,
    maintenance_policy: Value,
    auto_upgrade: bool,
    surge_upgrade: bool,
    ha: bool,
    /// Address of the cluster's Kubernetes API once it is running.
    endpoint: String,
    /// The API server's own loopback address (`ipv4`), once it has one.
    ipv4: Option<Ipv4Addr>,
    pools: Vec<Pool>,
}

/// A LoadBalancer Service seen in a simulated cluster, as the cloud controller reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceLb {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
    /// (port, protocol, nodePort)
    pub ports: Vec<(i64, String, Option<i64>)>,
}

/// What the cloud controller learns back about a Service's load balancer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbStatus {
    pub namespace: String,
    pub name: String,
    pub lb_id: String,
    pub active: bool,
    /// The load balancer's own loopback address.
    pub ip: Ipv4Addr,
}

#[derive(Debug, Clone)]
struct LoadBalancer {
    id: String,
    name: String,
    cluster_id: String,
    namespace: String,
    service: String,
    service_uid: String,
    network: String,
    lb_type: String,
    ports: Vec<(i64, String, Option<i64>)>,
    active: bool,
    until: Instant,
    vpc_uuid: String,
    created_at: String,
    /// Its own address from the region's loopback block, held from creation until it is gone
    /// (shown once it is active, as on DigitalOcean).
    ip: Ipv4Addr,
}

#[derive(Debug, Default)]
struct State {
    vpcs: Vec<Vpc>,
    clusters: Vec<Cluster>,
    lbs: Vec<LoadBalancer>,
    pending: Vec<Effect>,
    next_droplet: u64,
}

/// The region's cloud.
#[derive(Debug)]
pub struct World {
    region: String,
    state: Mutex<State>,
    delays: RwLock<Delays>,
    capacity: RwLock<BTreeMap<String, u32>>,
    /// Where load balancers get their addresses.
    addresses: Arc<Addresses>,
}

/// `render` of the items of `all` at positions `range` (clamped to it), and `all`'s length.
fn page<T>(all: &[T], range: Range<usize>, render: impl Fn(&T) -> Value) -> (Vec<Value>, usize) {
    let end = range.end.min(all.len());
    let start = range.start.min(end);
    (all[start..end].iter().map(render).collect(), all.len())
}

fn now_str() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn suffix() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    (0..5)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect()
}

fn unprocessable(msg: impl Into<String>) -> WorldError {
    WorldError::Unprocessable(msg.into())
}

/// DNS-label-ish names, which is what DigitalOcean accepts for clusters and pools.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && !name.starts_with('-')
}

fn region_object(slug: &str) -> Value {
    json!({
        "name": format!("Simulated {slug}"),
        "slug": slug,
        "features": ["private_networking", "backups", "ipv6", "metadata", "install_agent", "storage"],
        "available": true,
        "sizes": ["s-1vcpu-2gb", "s-2vcpu-4gb", "s-4vcpu-8gb", "gpu-h100x1-80gb", "gpu-h100x8-640gb", "gpu-mi300x1-192gb"],
    })
}

/// An account's default VPC in `region`. Every DigitalOcean account has one per region;
/// resources created without a `vpc_uuid` land in it. Its id depends only on the account and the
/// region, so a restarted simulator has the same one and the DIs a control plane kept in its
/// database still name a real VPC (their clusters are then rebuilt instead of failing).
fn default_vpc(region: &str, account: Option<Uuid>) -> Vpc {
    let seed = match account {
        None => format!("region-sim default VPC {region}"),
        Some(a) => format!("region-sim default VPC {region} {a}"),
    };
    let digest = Sha256::digest(seed);
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Vpc {
        id: uuid::Builder::from_custom_bytes(bytes)
            .into_uuid()
            .to_string(),
        account,
        name: format!("default-{region}"),
        description: String::new(),
        region: region.to_string(),
        ip_range: "10.100.0.0/20".into(),
        default: true,
        created_at: now_str(),
    }
}

impl World {
    pub fn new(region: &str, delays: Delays, capacity: BTreeMap<String, u32>) -> Self {
        Self::with_addresses(region, delays, capacity, Arc::new(Addresses::new()))
    }

    /// As [`World::new`], giving load balancers addresses from `addresses` (the ones the
    /// region's front serves).
    pub fn with_addresses(
        region: &str,
        delays: Delays,
        capacity: BTreeMap<String, u32>,
        addresses: Arc<Addresses>,
    ) -> Self {
        let world = Self {
            region: region.to_string(),
            state: Mutex::new(State {
                next_droplet: 400_000_000,
                ..Default::default()
            }),
            delays: RwLock::new(delays),
            capacity: RwLock::new(capacity),
            addresses,
        };
        let platform_default = default_vpc(region, None);
        world.lock().vpcs.push(platform_default);
        world
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("world lock")
    }

    pub fn region(&self) -> &str {
        &self.region
    }

    pub fn delays(&self) -> Delays {
        self.delays.read().expect("delays lock").clone()
    }

    pub fn set_delays(&self, d: Delays) {
        *self.delays.write().expect("delays lock") = d;
    }

    pub fn capacity(&self) -> BTreeMap<String, u32> {
        self.capacity.read().expect("capacity lock").clone()
    }

    pub fn set_capacity(&self, c: BTreeMap<String, u32>) {
        *self.capacity.write().expect("capacity lock") = c;
    }

    /// Drains the queued side effects.
    pub fn take_effects(&self) -> Vec<Effect> {
        std::mem::take(&mut self.lock().pending)
    }

    /// Advances every timed state to `now` and returns the queued side effects.
    pub fn tick(&self, now: Instant) -> Vec<Effect> {
        let delays = self.delays();
        let mut st = self.lock();
        let mut effects = std::mem::take(&mut st.pending);
        let mut gone_clusters = Vec::new();
        let mut next_droplet = st.next_droplet;
        for c in &mut st.clusters {
            match c.state {
                ClusterState::Provisioning if now >= c.until => {
                    c.state = ClusterState::Running;
                    c.updated_at = now_str();
                }
                ClusterState::Deleting if now >= c.until => {
                    gone_clusters.push(c.id.clone());
                    continue;
                }
                _ => {}
            }
            let running = c.state == ClusterState::Running;
            let cid = c.id.clone();
            c.pools.retain(|p| {
                let gone = p.deleting_until.is_some_and(|u| now >= u);
                if gone {
                    for n in p.nodes.iter().filter(|n| n.in_kube) {
                        effects.push(Effect::DeleteNode {
                            cluster_id: cid.clone(),
                            name: n.name.clone(),
                        });
                    }
                }
                !gone
            });
            for p in &mut c.pools {
                // Nodes that just came up; their objects are built once the pool is done
                // changing (this runs every tick, so nothing is copied unless a node turns up).
                let mut joined = Vec::new();
                p.nodes.retain_mut(|n| match n.state {
                    NodeState::Provisioning if running && now >= n.until => {
                        n.state = NodeState::Running;
                        n.updated_at = now_str();
                        n.in_kube = true;
                        joined.push(n.id.clone());
                        true
                    }
                    NodeState::Deleting if now >= n.until => {
                        if n.in_kube {
                            effects.push(Effect::DeleteNode {
                                cluster_id: cid.clone(),
                                name: n.name.clone(),
                            });
                        }
                        false
                    }
                    _ => true,
                });
                for n in p.nodes.iter().filter(|n| joined.contains(&n.id)) {
                    effects.push(Effect::UpsertNode {
                        cluster_id: cid.clone(),
                        node: node_object(p, n, &cid),
                    });
                }
                // Keep `count` nodes alive: replaces killed nodes the way node auto-repair does.
                if p.deleting_until.is_none() && c.state != ClusterState::Deleting {
                    let live = p
                        .nodes
                        .iter()
                        .filter(|n| n.state != NodeState::Deleting)
                        .count() as u32;
                    for _ in live..p.count {
                        next_droplet += 1;
                        let stamp = now_str();
                        p.nodes.push(Node {
                            id: Uuid::new_v4().to_string(),
                            name: format!("{}-{}", p.name, suffix()),
                            droplet_id: next_droplet.to_string(),
                            state: NodeState::Provisioning,
                            until: now + ms(delays.node_provision_ms),
                            created_at: stamp.clone(),
                            updated_at: stamp,
                            in_kube: false,
                            killed: false,
                        });
                    }
                }
            }
        }
        st.next_droplet = next_droplet;
        if !gone_clusters.is_empty() {
            st.clusters.retain(|c| !gone_clusters.contains(&c.id));
            let addresses = &self.addresses;
            st.lbs.retain(|l| {
                let gone = gone_clusters.contains(&l.cluster_id);
                if gone {
                    addresses.release(l.ip);
                }
                !gone
            });
            for id in gone_clusters {
                effects.push(Effect::ClusterGone { cluster_id: id });
            }
        }
        for l in &mut st.lbs {
            if !l.active && now >= l.until {
                l.active = true;
            }
        }
        effects
    }

    /// Every simulated cloud resource, flat, for leak checks.
    pub fn inventory(&self) -> CloudInventory {
        let st = self.lock();
        let mut inv = CloudInventory {
            vpcs: st
                .vpcs
                .iter()
                .map(|v| {
                    let mut out = Self::vpc_json(v);
                    out["account"] = json!(v.account);
                    out
                })
                .collect(),
            ..Default::default()
        };
        for c in &st.clusters {
            inv.clusters.push(json!({
                "id": c.id, "name": c.name, "state": c.state.as_str(), "vpc_uuid": c.vpc_uuid,
            }));
            for p in &c.pools {
                inv.node_pools.push(json!({
                    "id": p.id, "cluster_id": c.id, "name": p.name, "size": p.size.slug,
                    "count": p.count, "deleting": p.deleting_until.is_some(),
                }));
                for n in &p.nodes {
                    inv.nodes.push(json!({
                        "id": n.id, "name": n.name, "cluster_id": c.id, "node_pool_id": p.id,
                        "state": n.state.as_str(), "killed": n.killed,
                    }));
                }
            }
        }
        inv.load_balancers = st.lbs.iter().map(|l| self.lb_json(l)).collect();
        for (slug, limit) in self.capacity() {
            let used = Self::used(&st, &slug, None);
            inv.gpu_capacity
                .insert(slug, json!({"capacity": limit, "used": used}));
        }
        inv
    }

    /// Cluster ids, for iterating over the simulated Kubernetes clusters.
    pub fn cluster_ids(&self) -> Vec<String> {
        self.lock().clusters.iter().map(|c| c.id.clone()).collect()
    }
}

/// Cloud-side part of the inventory.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CloudInventory {
    pub vpcs: Vec<Value>,
    pub clusters: Vec<Value>,
    pub node_pools: Vec<Value>,
    pub nodes: Vec<Value>,
    pub load_balancers: Vec<Value>,
    pub gpu_capacity: BTreeMap<String, Value>,
}

fn validate_taint(t: &Taint) -> Result<(), WorldError> {
    if t.key.is_empty() {
        return Err(unprocessable("taint key must not be empty"));
    }
    if !matches!(
        t.effect.as_str(),
        "NoSchedule" | "PreferNoSchedule" | "NoExecute"
    ) {
        return Err(unprocessable(format!(
            "taint effect must be NoSchedule, PreferNoSchedule or NoExecute, not {:?}",
            t.effect
        )));
    }
    Ok(())
}

/// The Kubernetes Node object DOKS would register for `n`.
fn node_object(p: &Pool, n: &Node, cluster_id: &str) -> Value {
    let mut labels = serde_json::Map::new();
    // Pool labels first so that the DOKS-managed ones win, as the DOKS reconciler enforces them.
    for (k, v) in p.labels.clone().unwrap_or_default() {
        labels.insert(k, json!(v));
    }
    for (k, v) in [
        ("kubernetes.io/hostname", n.name.clone()),
        ("kubernetes.io/os", "linux".into()),
        ("kubernetes.io/arch", "amd64".into()),
        ("node.kubernetes.io/instance-type", p.size.slug.clone()),
        ("beta.kubernetes.io/instance-type", p.size.slug.clone()),
        ("doks.digitalocean.com/node-pool", p.name.clone()),
        ("doks.digitalocean.com/node-pool-id", p.id.clone()),
        ("doks.digitalocean.com/node-id", n.id.clone()),
        ("doks.digitalocean.com/version", DEFAULT_K8S_VERSION.into()),
        ("doks.digitalocean.com/cluster-id", cluster_id.into()),
    ] {
        labels.insert(k.into(), json!(v));
    }
    let mut taints: Vec<Value> = p
        .taints
        .iter()
        .map(|t| json!({"key": t.key, "value": t.value, "effect": t.effect}))
        .collect();
    let mut resources = serde_json::Map::new();
    resources.insert("cpu".into(), json!(p.size.vcpus.to_string()));
    resources.insert("memory".into(), json!(format!("{}Gi", p.size.memory_gib)));
    resources.insert("pods".into(), json!("110"));
    resources.insert("ephemeral-storage".into(), json!("100Gi"));
    if let (Some(brand), Some(res)) = (p.size.gpu_brand, p.size.gpu_resource()) {
        labels.insert("doks.digitalocean.com/gpu-brand".into(), json!(brand));
        if let Some(m) = &p.size.gpu_model {
            labels.insert("doks.digitalocean.com/gpu-model".into(), json!(m));
        }
        resources.insert(res.into(), json!(p.size.gpus.to_string()));
        taints.push(json!({"key": res, "effect": "NoSchedule"}));
    }
    let now = now_str();
    let ready = if n.killed {
        if !taints
            .iter()
            .any(|t| t["key"] == "node.kubernetes.io/unreachable")
        {
            taints.push(json!({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now}));
            taints.push(json!({"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule", "timeAdded": now}));
        }
        json!({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now, "lastTransitionTime": now})
    } else {
        json!({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status", "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    let octet = n.droplet_id.parse::<u64>().unwrap_or(0);
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": n.name,
            "labels": labels,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "providerID": format!("digitalocean://{}", n.droplet_id),
            "taints": taints,
        },
        "status": {
            "capacity": resources.clone(),
            "allocatable": resources,
            "conditions": [ready],
            "addresses": [
                {"type": "InternalIP", "address": format!("10.100.{}.{}", (octet / 250) % 250, octet % 250 + 2)},
                {"type": "Hostname", "address": n.name},
            ],
            "nodeInfo": {
                "kubeletVersion": format!("v{}", DEFAULT_K8S_VERSION.split('-').next().unwrap_or("1.33.1")),
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "containerd://1.7.27",
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world() -> World {
        World::new("atl1", Delays::instant(), default_capacity())
    }

    fn pool(name: &str, size: &str, count: i64) -> PoolSpec {
        PoolSpec {
            name: Some(name.into()),
            size: Some(size.into()),
            count: Some(count),
            tags: None,
            labels: Some([("di".to_string(), "x".to_string())].into()),
            taints: None,
            auto_scale: None,
            min_nodes: None,
            max_nodes: None,
        }
    }

    fn create(w: &World, pools: Vec<PoolSpec>) -> String {
        let c = w
            .cluster_create(ClusterCreate {
                name: Some("c1".into()),
                region: Some("atl1".into()),
                version: Some("latest".into()),
                vpc_uuid: None,
                tags: None,
                node_pools: Some(pools),
                maintenance_policy: None,
                auto_upgrade: None,
                surge_upgrade: None,
                ha: None,
            })
            .unwrap();
        c["id"].as_str().unwrap().to_string()
    }

    #[test]
    fn cluster_runs_then_nodes_become_kube_nodes() {
        let w = world();
        let id = create(&w, vec![pool("gpu", "gpu-mi300x1-192gb", 2)]);
        assert_eq!(
            w.cluster_get(&id).unwrap()["status"]["state"],
            "provisioning"
        );
        let mut e = w.tick(Instant::now());
        assert!(matches!(e[0], Effect::ClusterCreated { .. }));
        assert_eq!(w.cluster_get(&id).unwrap()["status"]["state"], "running");
        e.extend(w.tick(Instant::now()));
        let nodes: Vec<&Value> = e
            .iter()
            .filter_map(|e| match e {
                Effect::UpsertNode { node, .. } => Some(node),
                _ => None,
            })
            .collect();
        assert_eq!(nodes.len(), 2);
        let n = nodes[0];
        assert_eq!(
            n["metadata"]["labels"]["doks.digitalocean.com/gpu-brand"],
            "amd"
        );
        assert_eq!(
            n["metadata"]["labels"]["doks.digitalocean.com/node-pool"],
            "gpu"
        );
        assert_eq!(n["metadata"]["labels"]["di"], "x");
        assert_eq!(n["status"]["allocatable"]["amd.com/gpu"], "1");
        assert_eq!(n["spec"]["taints"][0]["key"], "amd.com/gpu");
        assert!(n["metadata"]["name"].as_str().unwrap().starts_with("gpu-"));
    }

    #[test]
    fn capacity_is_shared_and_released() {
        let w = world();
        w.set_capacity([("gpu-h100x1-80gb".to_string(), 3)].into());
        let id = create(&w, vec![pool("a", "gpu-h100x1-80gb", 2)]);
        let err = w
            .pool_create(&id, pool("b", "gpu-h100x1-80gb", 2))
            .unwrap_err();
        assert!(matches!(err, WorldError::Unprocessable(m) if m.contains("capacity")));
        let b = w.pool_create(&id, pool("b", "gpu-h100x1-80gb", 1)).unwrap();
        let b_id = b["id"].as_str().unwrap();
        // Unconfigured GPU sizes are not offered at all.
        assert!(w
            .pool_create(&id, pool("c", "gpu-h200x8-1128gb", 1))
            .is_err());
        w.pool_delete(&id, b_id).unwrap();
        w.tick(Instant::now());
        w.pool_create(&id, pool("d", "gpu-h100x1-80gb", 1)).unwrap();
    }

    #[test]
    fn scale_down_and_kill_replace_nodes() {
        let w = world();
        let id = create(&w, vec![pool("p", "s-2vcpu-4gb", 3)]);
        w.tick(Instant::now());
        w.tick(Instant::now());
        let pools = w.pool_list(&id).unwrap();
        let pid = pools[0]["id"].as_str().unwrap().to_string();
        let mut upd = pool("p", "s-2vcpu-4gb", 1);
        upd.size = None;
        w.pool_update(&id, &pid, upd).unwrap();
        let e = w.tick(Instant::now());
        assert_eq!(
            e.iter()
                .filter(|e| matches!(e, Effect::DeleteNode { .. }))
                .count(),
            2
        );
        let p = w.pool_get(&id, &pid).unwrap();
        assert_eq!(p["nodes"].as_array().unwrap().len(), 1);
        let name = p["nodes"][0]["name"].as_str().unwrap().to_string();
        w.kill_node(&name).unwrap();
        let e = w.tick(Instant::now());
        assert!(e
            .iter()
            .any(|e| matches!(e, Effect::DeleteNode { name: n, .. } if *n == name)));
        w.tick(Instant::now());
        let p = w.pool_get(&id, &pid).unwrap();
        assert_eq!(p["nodes"][0]["status"]["state"], "running");
        assert_ne!(p["nodes"][0]["name"], name.as_str());
    }

    #[test]
    fn load_balancers_get_addresses_of_their_own_and_give_them_back() {
        let w = world();
        let id = create(&w, vec![pool("p", "s-2vcpu-4gb", 1)]);
        let svc = |n: &str| ServiceLb {
            namespace: "ns".into(),
            name: n.into(),
            uid: format!("u-{n}"),
            annotations: BTreeMap::new(),
            ports: vec![(443, "TCP".into(), None)],
        };
        let first = w.lb_sync(&id, &[svc("a"), svc("b")]);
        assert_ne!(first[0].ip, first[1].ip);
        let again = w.lb_sync(&id, &[svc("a"), svc("b")]);
        assert_eq!(
            (again[0].ip, again[1].ip),
            (first[0].ip, first[1].ip),
            "an address stays with its load balancer"
        );
        w.lb_sync(&id, &[svc("a")]);
        assert_eq!(w.addresses.in_use(), 1, "b's address was given back");
        let later = w.lb_sync(&id, &[svc("a"), svc("c")]);
        assert_eq!(later[0].ip, first[0].ip);
        assert!(
            later[1].ip != first[1].ip && later[1].ip != first[0].ip,
            "a released address does not come round at once"
        );
    }

    #[test]
    fn delete_cluster_removes_everything() {
        let w = world();
        let id = create(&w, vec![pool("p", "s-2vcpu-4gb", 1)]);
        w.tick(Instant::now());
        let svc = ServiceLb {
            namespace: "ns".into(),
            name: "gw".into(),
            uid: "u-1".into(),
            annotations: [(
                "service.beta.kubernetes.io/do-loadbalancer-network".to_string(),
                "INTERNAL".to_string(),
            )]
            .into(),
            ports: vec![(443, "TCP".into(), Some(30443))],
        };
        let s = w.lb_sync(&id, std::slice::from_ref(&svc));
        assert_eq!(s.len(), 1);
        w.tick(Instant::now());
        let lb = w.lb_get(&s[0].lb_id).unwrap();
        assert_eq!(lb["network"], "INTERNAL");
        assert_eq!(lb["status"], "active");
        // The load balancer has an address of its own, which it holds until it is gone.
        assert_eq!(lb["ip"], s[0].ip.to_string());
        assert!(s[0].ip.is_loopback() && s[0].ip != Ipv4Addr::LOCALHOST);
        assert_eq!(w.addresses.in_use(), 1);
        w.cluster_delete(&id).unwrap();
        assert_eq!(w.cluster_get(&id).unwrap()["status"]["state"], "deleting");
        let e = w.tick(Instant::now());
        assert!(e.iter().any(|e| matches!(e, Effect::ClusterGone { .. })));
        assert_eq!(w.cluster_get(&id), Err(WorldError::NotFound));
        assert!(w.lb_list().is_empty());
        assert_eq!(
            w.addresses.in_use(),
            0,
            "the address went with the load balancer"
        );
        let inv = w.inventory();
        assert!(inv.clusters.is_empty() && inv.nodes.is_empty() && inv.node_pools.is_empty());
    }
}

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
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::front::Addresses;
use crate::sizes::{self, SizeInfo};

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

    // ---------------------------------------------------------------- VPCs

    fn vpc_json(v: &Vpc) -> Value {
        json!({
            "id": v.id,
            "urn": format!("do:vpc:{}", v.id),
            "name": v.name,
            "description": v.description,
            "region": v.region,
            "ip_range": v.ip_range,
            "default": v.default,
            "created_at": v.created_at,
        })
    }

    /// The VPCs `acting` sees: an account its own (its default VPC made on first use, as
    /// DigitalOcean does), the platform every account's.
    pub fn vpc_list(&self, acting: Option<Uuid>) -> Vec<Value> {
        self.vpc_page(acting, 0..usize::MAX).0
    }

    /// The VPCs the caller sees at positions `range` (fewer past the end), and how many it sees.
    pub fn vpc_page(&self, acting: Option<Uuid>, range: Range<usize>) -> (Vec<Value>, usize) {
        let mut st = self.lock();
        if acting.is_some() {
            self.ensure_default_vpc(&mut st, acting);
        }
        let seen: Vec<&Vpc> = st
            .vpcs
            .iter()
            .filter(|v| acting.is_none() || v.account == acting)
            .collect();
        page(&seen, range, |v| Self::vpc_json(v))
    }

    fn ensure_default_vpc(&self, st: &mut State, account: Option<Uuid>) {
        if !st.vpcs.iter().any(|v| v.default && v.account == account) {
            st.vpcs.push(default_vpc(&self.region, account));
        }
    }

    /// Another account's VPC is not found, as on DigitalOcean.
    pub fn vpc_get(&self, acting: Option<Uuid>, id: &str) -> Result<Value, WorldError> {
        let mut st = self.lock();
        if acting.is_some() {
            self.ensure_default_vpc(&mut st, acting);
        }
        st.vpcs
            .iter()
            .find(|v| v.id == id && (acting.is_none() || v.account == acting))
            .map(Self::vpc_json)
            .ok_or(WorldError::NotFound)
    }

    /// A VPC of `acting` (the platform's own without one).
    pub fn vpc_create(&self, acting: Option<Uuid>, req: VpcCreate) -> Result<Value, WorldError> {
        if req.name.is_empty()
            || !req
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        {
            return Err(unprocessable(
                "name must contain only letters, digits, '-' and '.'",
            ));
        }
        if req.region != self.region {
            return Err(unprocessable(format!(
                "region {} is not available; this region is {}",
                req.region, self.region
            )));
        }
        if req.description.as_deref().map(str::len).unwrap_or(0) > 255 {
            return Err(unprocessable("description must be at most 255 characters"));
        }
        let mut st = self.lock();
        self.ensure_default_vpc(&mut st, acting);
        let own = |v: &&Vpc| v.account == acting;
        if st.vpcs.iter().filter(own).any(|v| v.name == req.name) {
            return Err(unprocessable(format!(
                "a VPC named {} already exists",
                req.name
            )));
        }
        let ip_range = match req.ip_range {
            Some(r) => {
                if st.vpcs.iter().filter(own).any(|v| v.ip_range == r) {
                    return Err(unprocessable(format!(
                        "ip_range {r} overlaps an existing VPC"
                    )));
                }
                r
            }
            None => format!(
                "10.{}.0.0/20",
                110 + st.vpcs.iter().filter(own).count() % 100
            ),
        };
        let vpc = Vpc {
            id: Uuid::new_v4().to_string(),
            account: acting,
            name: req.name,
            description: req.description.unwrap_or_default(),
            region: req.region,
            ip_range,
            default: false,
            created_at: now_str(),
        };
        let out = Self::vpc_json(&vpc);
        st.vpcs.push(vpc);
        Ok(out)
    }

    pub fn vpc_delete(&self, acting: Option<Uuid>, id: &str) -> Result<(), WorldError> {
        let mut st = self.lock();
        let idx = st
            .vpcs
            .iter()
            .position(|v| v.id == id && (acting.is_none() || v.account == acting))
            .ok_or(WorldError::NotFound)?;
        if st.vpcs[idx].default {
            return Err(WorldError::Conflict("cannot delete the default VPC".into()));
        }
        if st.clusters.iter().any(|c| c.vpc_uuid == id) || st.lbs.iter().any(|l| l.vpc_uuid == id) {
            return Err(WorldError::Conflict(
                "cannot delete a VPC that still has members".into(),
            ));
        }
        st.vpcs.remove(idx);
        Ok(())
    }

    // ---------------------------------------------------------------- capacity

    /// Nodes of `slug` that occupy hardware, excluding pool `except` (whose share is recomputed).
    fn used(st: &State, slug: &str, except: Option<&str>) -> u32 {
        st.clusters
            .iter()
            .flat_map(|c| c.pools.iter())
            .filter(|p| p.size.slug == slug)
            .map(|p| {
                if Some(p.id.as_str()) == except {
                    // Nodes already being deleted still hold their hardware until they are gone.
                    p.nodes
                        .iter()
                        .filter(|n| n.state == NodeState::Deleting)
                        .count() as u32
                } else {
                    p.nodes.len().max(p.count as usize) as u32
                }
            })
            .sum()
    }

    fn check_capacity(
        &self,
        st: &State,
        size: &SizeInfo,
        except: Option<&str>,
        want: u32,
        extra_same_request: u32,
    ) -> Result<(), WorldError> {
        let cap = self.capacity.read().expect("capacity lock");
        let limit = match cap.get(&size.slug) {
            Some(l) => *l,
            // Sizes without a configured capacity: CPU sizes are plentiful, GPUs are not offered.
            None if size.is_gpu() => 0,
            None => return Ok(()),
        };
        let used = Self::used(st, &size.slug, except) + extra_same_request;
        if used + want > limit {
            let available = limit.saturating_sub(used);
            return Err(unprocessable(format!(
                "insufficient capacity: size {} has {} of {} requested nodes available in region {}",
                size.slug, available, want, self.region
            )));
        }
        Ok(())
    }

    // ---------------------------------------------------------------- clusters

    fn validate_pool(
        spec: &PoolSpec,
    ) -> Result<(String, SizeInfo, u32, bool, u32, u32), WorldError> {
        let name = spec
            .name
            .clone()
            .ok_or_else(|| unprocessable("node pool name is required"))?;
        if !valid_name(&name) {
            return Err(unprocessable(format!(
                "node pool name {name:?} must consist of lower case alphanumeric characters, '-' or '.'"
            )));
        }
        let slug = spec
            .size
            .clone()
            .ok_or_else(|| unprocessable("node pool size is required"))?;
        let size = sizes::parse(&slug)
            .ok_or_else(|| unprocessable(format!("invalid size slug: {slug}")))?;
        let auto_scale = spec.auto_scale.unwrap_or(false);
        let count = spec.count.unwrap_or(if auto_scale {
            spec.min_nodes.unwrap_or(0)
        } else {
            -1
        });
        if !(0..=512).contains(&count) {
            return Err(unprocessable("node pool count must be between 0 and 512"));
        }
        if count == 0 && !auto_scale {
            return Err(unprocessable(
                "node pool count must be at least 1 unless auto_scale is enabled",
            ));
        }
        let (min, max) = if auto_scale {
            let min = spec.min_nodes.unwrap_or(0);
            let max = spec.max_nodes.unwrap_or(count.max(1));
            if min < 0 || max < min || max == 0 || count < min || count > max {
                return Err(unprocessable(
                    "auto_scale requires 0 <= min_nodes <= count <= max_nodes and max_nodes >= 1",
                ));
            }
            (min as u32, max as u32)
        } else {
            (0, 0)
        };
        if let Some(taints) = &spec.taints {
            for t in taints {
                validate_taint(t)?;
            }
        }
        Ok((name, size, count as u32, auto_scale, min, max))
    }

    fn new_node(st: &mut State, pool_name: &str, until: Instant) -> Node {
        st.next_droplet += 1;
        let now = now_str();
        Node {
            id: Uuid::new_v4().to_string(),
            name: format!("{pool_name}-{}", suffix()),
            droplet_id: st.next_droplet.to_string(),
            state: NodeState::Provisioning,
            until,
            created_at: now.clone(),
            updated_at: now,
            in_kube: false,
            killed: false,
        }
    }

    fn build_pool(
        st: &mut State,
        cluster_id: &str,
        spec: &PoolSpec,
        checked: (String, SizeInfo, u32, bool, u32, u32),
        until: Instant,
    ) -> Pool {
        let (name, size, count, auto_scale, min_nodes, max_nodes) = checked;
        let mut tags = vec![
            "k8s".to_string(),
            format!("k8s:{cluster_id}"),
            "k8s:worker".to_string(),
        ];
        for t in spec.tags.clone().unwrap_or_default() {
            if !tags.contains(&t) {
                tags.push(t);
            }
        }
        let nodes = (0..count)
            .map(|_| Self::new_node(st, &name, until))
            .collect();
        Pool {
            id: Uuid::new_v4().to_string(),
            name,
            size,
            count,
            tags,
            labels: spec.labels.clone(),
            taints: spec.taints.clone().unwrap_or_default(),
            auto_scale,
            min_nodes,
            max_nodes,
            nodes,
            deleting_until: None,
        }
    }

    pub fn cluster_create(&self, req: ClusterCreate) -> Result<Value, WorldError> {
        let name = req
            .name
            .clone()
            .ok_or_else(|| unprocessable("name is required"))?;
        if !valid_name(&name) {
            return Err(unprocessable(format!(
                "name {name:?} must consist of lower case alphanumeric characters, '-' or '.'"
            )));
        }
        let region = req
            .region
            .clone()
            .ok_or_else(|| unprocessable("region is required"))?;
        if region != self.region {
            return Err(unprocessable(format!(
                "region {region} is not available; this region is {}",
                self.region
            )));
        }
        let version = match req.version.as_deref() {
            None => return Err(unprocessable("version is required")),
            Some("latest") | Some("1.33") => DEFAULT_K8S_VERSION.to_string(),
            Some(v) if v.contains("-do.") => v.to_string(),
            Some(v) => return Err(unprocessable(format!("invalid version: {v}"))),
        };
        let specs = req.node_pools.clone().unwrap_or_default();
        if specs.is_empty() {
            return Err(unprocessable(
                "a cluster must be created with at least one node pool",
            ));
        }
        let mut checked = Vec::new();
        for s in &specs {
            let c = Self::validate_pool(s)?;
            if checked
                .iter()
                .any(|(n, ..): &(String, _, _, _, _, _)| *n == c.0)
            {
                return Err(unprocessable(format!(
                    "node pool names must be unique: {}",
                    c.0
                )));
            }
            checked.push(c);
        }
        if !checked.iter().any(|c| c.2 > 0) {
            return Err(unprocessable(
                "a cluster must be created with at least one node",
            ));
        }
        let delays = self.delays();
        let mut st = self.lock();
        let vpc_uuid = match &req.vpc_uuid {
            Some(id) if !id.is_empty() => {
                if !st.vpcs.iter().any(|v| &v.id == id) {
                    return Err(unprocessable(format!("vpc_uuid {id} does not exist")));
                }
                id.clone()
            }
            _ => st
                .vpcs
                .iter()
                .find(|v| v.default)
                .map(|v| v.id.clone())
                .unwrap_or_default(),
        };
        if st
            .clusters
            .iter()
            .any(|c| c.name == name && c.state != ClusterState::Deleting)
        {
            return Err(WorldError::Conflict(format!(
                "a cluster named {name} already exists"
            )));
        }
        // Pools of the same size in one request share the capacity.
        let mut same_request: BTreeMap<String, u32> = BTreeMap::new();
        for c in &checked {
            let extra = same_request.get(&c.1.slug).copied().unwrap_or(0);
            self.check_capacity(&st, &c.1, None, c.2, extra)?;
            *same_request.entry(c.1.slug.clone()).or_default() += c.2;
        }
        let id = Uuid::new_v4().to_string();
        let now = Instant::now();
        let node_until = now + ms(delays.cluster_provision_ms) + ms(delays.node_provision_ms);
        let pools = specs
            .iter()
            .zip(checked)
            .map(|(s, c)| Self::build_pool(&mut st, &id, s, c, node_until))
            .collect();
        let mut tags = vec!["k8s".to_string(), format!("k8s:{id}")];
        for t in req.tags.unwrap_or_default() {
            if !tags.contains(&t) {
                tags.push(t);
            }
        }
        let created = now_str();
        let cluster = Cluster {
            id: id.clone(),
            name: name.clone(),
            region,
            version,
            vpc_uuid,
            tags,
            state: ClusterState::Provisioning,
            until: now + ms(delays.cluster_provision_ms),
            created_at: created.clone(),
            updated_at: created,
            maintenance_policy: req.maintenance_policy.unwrap_or_else(
                || json!({"start_time": "00:00", "duration": "4h0m0s", "day": "any"}),
            ),
            auto_upgrade: req.auto_upgrade.unwrap_or(false),
            surge_upgrade: req.surge_upgrade.unwrap_or(false),
            ha: req.ha.unwrap_or(true),
            endpoint: String::new(),
            ipv4: None,
            pools,
        };
        let out = Self::cluster_json(&cluster);
        st.clusters.push(cluster);
        st.pending.push(Effect::ClusterCreated {
            cluster_id: id,
            name,
        });
        Ok(out)
    }

    /// Records where the cluster's Kubernetes API answers (its URL and address); shown once the
    /// cluster is running.
    pub fn set_cluster_endpoint(&self, cluster_id: &str, endpoint: &str, ipv4: Ipv4Addr) {
        if let Some(c) = self.lock().clusters.iter_mut().find(|c| c.id == cluster_id) {
            c.endpoint = endpoint.to_string();
            c.ipv4 = Some(ipv4);
        }
    }

    fn node_json(n: &Node) -> Value {
        json!({
            "id": n.id,
            "name": n.name,
            "status": {"state": n.state.as_str()},
            "droplet_id": n.droplet_id,
            "created_at": n.created_at,
            "updated_at": n.updated_at,
        })
    }

    fn pool_json(p: &Pool) -> Value {
        json!({
            "id": p.id,
            "name": p.name,
            "size": p.size.slug,
            "count": p.count,
            "tags": p.tags,
            "labels": p.labels,
            "taints": p.taints,
            "auto_scale": p.auto_scale,
            "min_nodes": p.min_nodes,
            "max_nodes": p.max_nodes,
            "nodes": p.nodes.iter().map(Self::node_json).collect::<Vec<_>>(),
        })
    }

    fn cluster_json(c: &Cluster) -> Value {
        let running = c.state == ClusterState::Running;
        let has_brand = |b: &str| c.pools.iter().any(|p| p.size.gpu_brand == Some(b));
        json!({
            "id": c.id,
            "name": c.name,
            "region": c.region,
            "version": c.version,
            "cluster_subnet": "10.244.0.0/16",
            "service_subnet": "10.245.0.0/16",
            "vpc_uuid": c.vpc_uuid,
            // The API server address is only known once the control plane is up.
            "ipv4": match c.ipv4 {
                Some(ip) if running => ip.to_string(),
                _ => String::new(),
            },
            "endpoint": if running { c.endpoint.as_str() } else { "" },
            "tags": c.tags,
            "node_pools": c.pools.iter().map(Self::pool_json).collect::<Vec<_>>(),
            "maintenance_policy": c.maintenance_policy,
            "auto_upgrade": c.auto_upgrade,
            "isolated_workers": false,
            "status": {"state": c.state.as_str(), "message": c.state.as_str()},
            "created_at": c.created_at,
            "updated_at": c.updated_at,
            "surge_upgrade": c.surge_upgrade,
            "registry_enabled": false,
            "registries": null,
            "ha": c.ha,
            "control_plane_firewall": {"enabled": false, "allowed_addresses": []},
            "cluster_autoscaler_configuration": {"scale_down_utilization_threshold": 0.5, "scale_down_unneeded_time": "1m0s", "expanders": []},
            "routing_agent": {"enabled": false},
            "amd_gpu_device_plugin": {"enabled": has_brand("amd")},
            "amd_gpu_device_metrics_exporter_plugin": {"enabled": has_brand("amd")},
            "nvidia_gpu_device_plugin": {"enabled": has_brand("nvidia")},
            "rdma_shared_dev_plugin": {"enabled": false},
            "coredns_autoscaler": {"enabled": false},
            "p2p_oci_registry_plugin": {"enabled": false},
        })
    }

    pub fn cluster_list(&self) -> Vec<Value> {
        self.cluster_page(0..usize::MAX).0
    }

    /// The clusters at positions `range` (fewer past the end), and how many there are.
    pub fn cluster_page(&self, range: Range<usize>) -> (Vec<Value>, usize) {
        page(&self.lock().clusters, range, Self::cluster_json)
    }

    pub fn cluster_get(&self, id: &str) -> Result<Value, WorldError> {
        self.lock()
            .clusters
            .iter()
            .find(|c| c.id == id)
            .map(Self::cluster_json)
            .ok_or(WorldError::NotFound)
    }

    /// Whether the cluster exists (in any state) — for the kubeconfig endpoint.
    pub fn cluster_exists(&self, id: &str) -> bool {
        self.lock().clusters.iter().any(|c| c.id == id)
    }

    pub fn cluster_name(&self, id: &str) -> Option<String> {
        self.lock()
            .clusters
            .iter()
            .find(|c| c.id == id)
            .map(|c| c.name.clone())
    }

    pub fn cluster_delete(&self, id: &str) -> Result<(), WorldError> {
        let until = Instant::now() + ms(self.delays().deletion_ms);
        let mut st = self.lock();
        let c = st
            .clusters
            .iter_mut()
            .find(|c| c.id == id)
            .ok_or(WorldError::NotFound)?;
        // Deleting twice is accepted, like the real API does while the cluster is still listed.
        if c.state != ClusterState::Deleting {
            c.state = ClusterState::Deleting;
            c.until = until;
            c.updated_at = now_str();
            for p in &mut c.pools {
                for n in &mut p.nodes {
                    n.state = NodeState::Deleting;
                    n.until = until;
                }
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- node pools

    fn cluster_mut<'a>(st: &'a mut State, id: &str) -> Result<&'a mut Cluster, WorldError> {
        st.clusters
            .iter_mut()
            .find(|c| c.id == id)
            .ok_or(WorldError::NotFound)
    }

    pub fn pool_list(&self, cluster_id: &str) -> Result<Vec<Value>, WorldError> {
        let st = self.lock();
        let c = st
            .clusters
            .iter()
            .find(|c| c.id == cluster_id)
            .ok_or(WorldError::NotFound)?;
        Ok(c.pools.iter().map(Self::pool_json).collect())
    }

    pub fn pool_get(&self, cluster_id: &str, pool_id: &str) -> Result<Value, WorldError> {
        let st = self.lock();
        st.clusters
            .iter()
            .find(|c| c.id == cluster_id)
            .and_then(|c| c.pools.iter().find(|p| p.id == pool_id))
            .map(Self::pool_json)
            .ok_or(WorldError::NotFound)
    }

    pub fn pool_create(&self, cluster_id: &str, spec: PoolSpec) -> Result<Value, WorldError> {
        let checked = Self::validate_pool(&spec)?;
        let delays = self.delays();
        let mut st = self.lock();
        {
            let c = Self::cluster_mut(&mut st, cluster_id)?;
            if c.state == ClusterState::Deleting {
                return Err(WorldError::Conflict("the cluster is being deleted".into()));
            }
            if c.pools.iter().any(|p| p.name == checked.0) {
                return Err(unprocessable(format!(
                    "a node pool named {} already exists in this cluster",
                    checked.0
                )));
            }
        }
        self.check_capacity(&st, &checked.1, None, checked.2, 0)?;
        let until = Instant::now() + ms(delays.node_provision_ms);
        let pool = Self::build_pool(&mut st, cluster_id, &spec, checked, until);
        let out = Self::pool_json(&pool);
        let c = Self::cluster_mut(&mut st, cluster_id)?;
        c.pools.push(pool);
        c.updated_at = now_str();
        Ok(out)
    }

    pub fn pool_update(
        &self,
        cluster_id: &str,
        pool_id: &str,
        spec: PoolSpec,
    ) -> Result<Value, WorldError> {
        let delays = self.delays();
        let mut st = self.lock();
        let (size, name) = {
            let c = Self::cluster_mut(&mut st, cluster_id)?;
            let p = c
                .pools
                .iter()
                .find(|p| p.id == pool_id)
                .ok_or(WorldError::NotFound)?;
            if c.state == ClusterState::Deleting || p.deleting_until.is_some() {
                return Err(WorldError::Conflict(
                    "the node pool is being deleted".into(),
                ));
            }
            (p.size.clone(), p.name.clone())
        };
        // The update schema requires name and count; size cannot change.
        let mut full = spec.clone();
        full.size = Some(size.slug.clone());
        if full.name.is_none() {
            return Err(unprocessable("name is required"));
        }
        if full.count.is_none() {
            return Err(unprocessable("count is required"));
        }
        let checked = Self::validate_pool(&full)?;
        if checked.0 != name {
            let c = Self::cluster_mut(&mut st, cluster_id)?;
            if c.pools.iter().any(|p| p.name == checked.0) {
                return Err(unprocessable(format!(
                    "a node pool named {} already exists in this cluster",
                    checked.0
                )));
            }
        }
        self.check_capacity(&st, &size, Some(pool_id), checked.2, 0)?;
        let add = {
            let c = Self::cluster_mut(&mut st, cluster_id)?;
            let p = c.pools.iter().find(|p| p.id == pool_id).expect("checked");
            let live = p
                .nodes
                .iter()
                .filter(|n| n.state != NodeState::Deleting)
                .count() as u32;
            checked.2.saturating_sub(live)
        };
        let until = Instant::now() + ms(delays.node_provision_ms);
        let pool_name = checked.0.clone();
        let fresh: Vec<Node> = (0..add)
            .map(|_| Self::new_node(&mut st, &pool_name, until))
            .collect();
        let mut effects = Vec::new();
        let c = Self::cluster_mut(&mut st, cluster_id)?;
        let cid = c.id.clone();
        let p = c
            .pools
            .iter_mut()
            .find(|p| p.id == pool_id)
            .expect("checked");
        let (_, _, count, auto_scale, min_nodes, max_nodes) = checked;
        let labels_changed = spec.labels.is_some() && spec.labels != p.labels;
        let taints_changed = spec.taints.is_some() && spec.taints.as_ref() != Some(&p.taints);
        p.name = pool_name;
        p.count = count;
        p.auto_scale = auto_scale;
        p.min_nodes = min_nodes;
        p.max_nodes = max_nodes;
        if let Some(tags) = spec.tags {
            let mut all = vec![
                "k8s".to_string(),
                format!("k8s:{cid}"),
                "k8s:worker".to_string(),
            ];
            for t in tags {
                if !all.contains(&t) {
                    all.push(t);
                }
            }
            p.tags = all;
        }
        if spec.labels.is_some() {
            p.labels = spec.labels;
        }
        if let Some(t) = spec.taints {
            p.taints = t;
        }
        // Scale down: the newest nodes go first.
        let live: Vec<usize> = p
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.state != NodeState::Deleting)
            .map(|(i, _)| i)
            .collect();
        let excess = (live.len() as u32).saturating_sub(count) as usize;
        let del_until = Instant::now() + ms(delays.deletion_ms);
        for &i in live.iter().rev().take(excess) {
            p.nodes[i].state = NodeState::Deleting;
            p.nodes[i].until = del_until;
            p.nodes[i].updated_at = now_str();
        }
        p.nodes.extend(fresh);
        if labels_changed || taints_changed {
            // Labels and taints follow the pool onto existing nodes.
            let pool = p.clone();
            for n in pool.nodes.iter().filter(|n| n.in_kube) {
                effects.push(Effect::UpsertNode {
                    cluster_id: cid.clone(),
                    node: node_object(&pool, n, &cid),
                });
            }
        }
        let out = Self::pool_json(p);
        c.updated_at = now_str();
        st.pending.extend(effects);
        Ok(out)
    }

    pub fn pool_delete(&self, cluster_id: &str, pool_id: &str) -> Result<(), WorldError> {
        let until = Instant::now() + ms(self.delays().deletion_ms);
        let mut st = self.lock();
        let c = Self::cluster_mut(&mut st, cluster_id)?;
        let p = c
            .pools
            .iter_mut()
            .find(|p| p.id == pool_id)
            .ok_or(WorldError::NotFound)?;
        if p.deleting_until.is_none() {
            p.deleting_until = Some(until);
            for n in &mut p.nodes {
                n.state = NodeState::Deleting;
                n.until = until;
                n.updated_at = now_str();
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- nodes

    /// `DELETE …/node_pools/{pool}/nodes/{node}`: the node is deleted after the deletion delay.
    /// Without `replace` the pool's count drops by one; with it the count stays and a new node
    /// takes its place (the tick keeps `count` nodes alive). Deleting a node that is already
    /// being deleted is accepted.
    pub fn node_delete(
        &self,
        cluster_id: &str,
        pool_id: &str,
        node_id: &str,
        replace: bool,
    ) -> Result<(), WorldError> {
        let until = Instant::now() + ms(self.delays().deletion_ms);
        let mut st = self.lock();
        let c = Self::cluster_mut(&mut st, cluster_id)?;
        if c.state == ClusterState::Deleting {
            return Err(WorldError::Conflict("the cluster is being deleted".into()));
        }
        let p = c
            .pools
            .iter_mut()
            .find(|p| p.id == pool_id)
            .ok_or(WorldError::NotFound)?;
        if p.deleting_until.is_some() {
            return Err(WorldError::Conflict(
                "the node pool is being deleted".into(),
            ));
        }
        let n = p
            .nodes
            .iter_mut()
            .find(|n| n.id == node_id)
            .ok_or(WorldError::NotFound)?;
        if n.state == NodeState::Deleting {
            return Ok(());
        }
        n.state = NodeState::Deleting;
        n.until = until;
        n.updated_at = now_str();
        if !replace {
            p.count = p.count.saturating_sub(1);
        }
        c.updated_at = now_str();
        Ok(())
    }

    /// Kills a node: it turns NotReady at once and is replaced like DOKS auto-repair would.
    pub fn kill_node(&self, name: &str) -> Result<(), WorldError> {
        let until = Instant::now() + ms(self.delays().deletion_ms);
        let mut st = self.lock();
        let mut effects = Vec::new();
        let mut found = false;
        for c in &mut st.clusters {
            let cid = c.id.clone();
            for p in &mut c.pools {
                let pool = p.clone();
                if let Some(n) = p.nodes.iter_mut().find(|n| n.name == name) {
                    found = true;
                    n.killed = true;
                    n.state = NodeState::Deleting;
                    n.until = until;
                    n.updated_at = now_str();
                    if n.in_kube {
                        effects.push(Effect::UpsertNode {
                            cluster_id: cid.clone(),
                            node: node_object(&pool, n, &cid),
                        });
                    }
                }
            }
        }
        st.pending.extend(effects);
        if found {
            Ok(())
        } else {
            Err(WorldError::NotFound)
        }
    }

    // ---------------------------------------------------------------- load balancers

    fn lb_json(&self, l: &LoadBalancer) -> Value {
        let rules: Vec<Value> = l
            .ports
            .iter()
            .map(|(port, proto, node_port)| {
                let p = proto.to_ascii_lowercase();
                json!({
                    "entry_protocol": p,
                    "entry_port": port,
                    "target_protocol": p,
                    "target_port": node_port.unwrap_or(*port),
                    "certificate_id": "",
                    "tls_passthrough": false,
                })
            })
            .collect();
        json!({
            "id": l.id,
            "name": l.name,
            "ip": if l.active { l.ip.to_string() } else { String::new() },
            "ipv6": "",
            "size_unit": 1,
            "size": "lb-small",
            "algorithm": "round_robin",
            "status": if l.active { "active" } else { "new" },
            "created_at": l.created_at,
            "forwarding_rules": rules,
            "health_check": {
                "protocol": "tcp",
                "port": 10256,
                "path": "",
                "check_interval_seconds": 3,
                "response_timeout_seconds": 5,
                "healthy_threshold": 5,
                "unhealthy_threshold": 3,
            },
            "sticky_sessions": {"type": "none"},
            "region": region_object(&self.region),
            "tag": format!("k8s:{}", l.cluster_id),
            "droplet_ids": [],
            "redirect_http_to_https": false,
            "enable_proxy_protocol": false,
            "enable_backend_keepalive": false,
            "http_idle_timeout_seconds": 60,
            "vpc_uuid": l.vpc_uuid,
            "disable_lets_encrypt_dns_records": false,
            "network": l.network,
            "network_stack": "IPV4",
            "type": l.lb_type,
            "tls_cipher_policy": "DEFAULT",
            "firewall": {"allow": [], "deny": []},
        })
    }

    pub fn lb_list(&self) -> Vec<Value> {
        self.lb_page(0..usize::MAX).0
    }

    /// The load balancers at positions `range` (fewer past the end), and how many there are.
    pub fn lb_page(&self, range: Range<usize>) -> (Vec<Value>, usize) {
        page(&self.lock().lbs, range, |l| self.lb_json(l))
    }

    pub fn lb_get(&self, id: &str) -> Result<Value, WorldError> {
        let st = self.lock();
        st.lbs
            .iter()
            .find(|l| l.id == id)
            .map(|l| self.lb_json(l))
            .ok_or(WorldError::NotFound)
    }

    /// The cloud controller's view: makes the cluster's load balancers match its LoadBalancer
    /// Services and reports each one's state back.
    pub fn lb_sync(&self, cluster_id: &str, services: &[ServiceLb]) -> Vec<LbStatus> {
        let delay = ms(self.delays().lb_provision_ms);
        let mut st = self.lock();
        let Some(vpc) = st
            .clusters
            .iter()
            .find(|c| c.id == cluster_id)
            .map(|c| c.vpc_uuid.clone())
        else {
            return Vec::new();
        };
        let wanted: BTreeSet<&str> = services.iter().map(|s| s.uid.as_str()).collect();
        let addresses = &self.addresses;
        st.lbs.retain(|l| {
            let keep = l.cluster_id != cluster_id || wanted.contains(l.service_uid.as_str());
            if !keep {
                addresses.release(l.ip);
            }
            keep
        });
        let mut out = Vec::new();
        for s in services {
            let ann = |k: &str| {
                s.annotations
                    .get(&format!("service.beta.kubernetes.io/do-loadbalancer-{k}"))
                    .cloned()
            };
            let existing = st
                .lbs
                .iter_mut()
                .find(|l| l.cluster_id == cluster_id && l.service_uid == s.uid);
            let lb = match existing {
                Some(l) => {
                    // Ports and the name can change in place; the network cannot (DO refuses
                    // to switch an LB between internal and external after creation).
                    l.ports = s.ports.clone();
                    if let Some(n) = ann("name") {
                        l.name = n;
                    }
                    l.clone()
                }
                None => {
                    // The cloud controller names LBs "a" + the Service UID without dashes.
                    let default_name: String = format!("a{}", s.uid.replace('-', ""))
                        .chars()
                        .take(32)
                        .collect();
                    let l = LoadBalancer {
                        id: Uuid::new_v4().to_string(),
                        name: ann("name").unwrap_or(default_name),
                        cluster_id: cluster_id.to_string(),
                        namespace: s.namespace.clone(),
                        service: s.name.clone(),
                        service_uid: s.uid.clone(),
                        network: ann("network")
                            .map(|n| n.to_ascii_uppercase())
                            .filter(|n| n == "INTERNAL" || n == "EXTERNAL")
                            .unwrap_or_else(|| "EXTERNAL".into()),
                        lb_type: ann("type")
                            .map(|n| n.to_ascii_uppercase())
                            .filter(|n| n == "REGIONAL" || n == "REGIONAL_NETWORK")
                            .unwrap_or_else(|| "REGIONAL_NETWORK".into()),
                        ports: s.ports.clone(),
                        active: false,
                        until: Instant::now() + delay,
                        vpc_uuid: vpc.clone(),
                        created_at: now_str(),
                        ip: self.addresses.allocate(),
                    };
                    st.lbs.push(l.clone());
                    l
                }
            };
            out.push(LbStatus {
                namespace: lb.namespace,
                name: lb.service,
                lb_id: lb.id,
                active: lb.active,
                ip: lb.ip,
            });
        }
        out
    }

    // ---------------------------------------------------------------- time

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

    // ---------------------------------------------------------------- inventory

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

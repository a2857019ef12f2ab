//! The API's request and response shapes the client reads and sends: VPCs, DOKS clusters, their
//! credentials, node pools and nodes, load balancers, and the bodies of creates and updates.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A VPC.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Vpc {
    pub id: String,
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub description: String,
    pub region: String,
    pub ip_range: String,
    /// The region's default VPC (clusters created without `vpc_uuid` land in it).
    pub default: bool,
    #[serde(deserialize_with = "null_as_default")]
    pub urn: String,
    pub created_at: String,
}

/// A node pool taint.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(default)]
pub struct Taint {
    pub key: String,
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// A node's lifecycle state as DigitalOcean reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Provisioning,
    Running,
    Draining,
    Deleting,
    /// Any state this client does not know.
    #[default]
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeStatus {
    pub state: NodeState,
    #[serde(deserialize_with = "null_as_default")]
    pub message: String,
}

/// A node (droplet) of a node pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Node {
    pub id: String,
    /// Also the Kubernetes Node name.
    pub name: String,
    pub status: NodeStatus,
    #[serde(deserialize_with = "null_as_default")]
    pub droplet_id: String,
    pub created_at: String,
    pub updated_at: String,
}

/// A DOKS node pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodePool {
    pub id: String,
    pub name: String,
    /// Size slug, e.g. `gpu-h100x1-80gb`.
    pub size: String,
    pub count: u32,
    /// Includes the tags DOKS adds (`k8s`, `k8s:<cluster id>`, `k8s:worker`).
    #[serde(deserialize_with = "null_as_default")]
    pub tags: Vec<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub labels: BTreeMap<String, String>,
    #[serde(deserialize_with = "null_as_default")]
    pub taints: Vec<Taint>,
    pub auto_scale: bool,
    /// 0 unless `auto_scale`.
    pub min_nodes: u32,
    /// 0 unless `auto_scale`.
    pub max_nodes: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub nodes: Vec<Node>,
}

impl NodePool {
    /// Nodes in `running` state.
    pub fn running_nodes(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.status.state == NodeState::Running)
            .count()
    }
}

/// A cluster's lifecycle state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    Running,
    Provisioning,
    Degraded,
    Error,
    Deleted,
    Upgrading,
    Deleting,
    /// Any state this client does not know.
    #[default]
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterStatus {
    pub state: ClusterState,
    #[serde(deserialize_with = "null_as_default")]
    pub message: String,
}

/// A cluster's maintenance window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MaintenancePolicy {
    /// `HH:MM`, UTC.
    pub start_time: String,
    /// Read-only, e.g. `4h0m0s`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub duration: String,
    /// `any`, `monday`, ... `sunday`.
    pub day: String,
}

/// A DOKS cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cluster {
    pub id: String,
    pub name: String,
    pub region: String,
    /// Version slug, e.g. `1.33.1-do.3`.
    pub version: String,
    pub vpc_uuid: String,
    pub cluster_subnet: String,
    pub service_subnet: String,
    /// The Kubernetes API URL; empty until the cluster is running.
    #[serde(deserialize_with = "null_as_default")]
    pub endpoint: String,
    #[serde(deserialize_with = "null_as_default")]
    pub ipv4: String,
    /// Includes the tags DOKS adds (`k8s`, `k8s:<cluster id>`).
    #[serde(deserialize_with = "null_as_default")]
    pub tags: Vec<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub node_pools: Vec<NodePool>,
    pub status: ClusterStatus,
    pub maintenance_policy: Option<MaintenancePolicy>,
    pub auto_upgrade: bool,
    pub surge_upgrade: bool,
    pub ha: bool,
    pub created_at: String,
    pub updated_at: String,
}

/// Token credentials for a DOKS cluster's API (`GET /v2/kubernetes/clusters/{id}/credentials`).
/// `Debug` leaves the token out.
#[derive(Clone, PartialEq)]
pub struct ClusterCredentials {
    /// The API server's URL.
    pub server: String,
    /// Base64 of the PEM CA certificate(s) the API server's certificate chains to, as the API
    /// returns it (and as a kubeconfig's `certificate-authority-data` carries it); empty when
    /// the response has none.
    pub certificate_authority_data: String,
    pub token: String,
    /// When the token stops being accepted; `None` when the response does not say.
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl fmt::Debug for ClusterCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCredentials")
            .field("server", &self.server)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl ClusterCredentials {
    /// How long the token has left at `now`: zero once expired, `None` when the response did
    /// not say when it expires.
    pub fn expires_in(&self, now: std::time::SystemTime) -> Option<Duration> {
        let at = std::time::SystemTime::from(self.expires_at?);
        Some(at.duration_since(now).unwrap_or(Duration::ZERO))
    }

    /// Parses a credentials response. Errors never quote the body: it holds the token.
    pub(super) fn from_body(body: &[u8]) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct Wire {
            server: String,
            #[serde(default)]
            certificate_authority_data: Option<String>,
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            expires_at: Option<String>,
        }
        let w: Wire = serde_json::from_slice(body).map_err(|e| {
            format!(
                "credentials are not the documented shape ({:?} error at line {} column {})",
                e.classify(),
                e.line(),
                e.column()
            )
        })?;
        let token = w.token.filter(|t| !t.is_empty()).ok_or_else(|| {
            "the credentials carry no token (certificate-only clusters are not supported)"
                .to_string()
        })?;
        // RFC 3339; DigitalOcean's examples also write a space for the `T`, which the relaxed
        // parser of `FromStr` accepts.
        let expires_at = match w.expires_at.filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(
                s.parse::<chrono::DateTime<chrono::FixedOffset>>()
                    .map_err(|_| format!("expires_at {s:?} is not a date-time"))?
                    .with_timezone(&chrono::Utc),
            ),
        };
        Ok(ClusterCredentials {
            server: w.server,
            certificate_authority_data: w.certificate_authority_data.unwrap_or_default(),
            token,
            expires_at,
        })
    }
}

/// Body of `POST /v2/kubernetes/clusters/{id}/node_pools`, and a pool in a cluster create.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodePoolCreateRequest {
    pub name: String,
    pub size: String,
    pub count: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_scale: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<u32>,
}

impl NodePoolCreateRequest {
    pub fn new(name: impl Into<String>, size: impl Into<String>, count: u32) -> Self {
        Self {
            name: name.into(),
            size: size.into(),
            count,
            ..Default::default()
        }
    }
}

/// Body of `PUT /v2/kubernetes/clusters/{id}/node_pools/{pool_id}`. DigitalOcean requires `name`
/// and `count`; the size cannot change. `None` leaves a field as it is; `Some` replaces it
/// (DOKS keeps a label removed from the pool on existing nodes; a removed taint goes).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodePoolUpdateRequest {
    pub name: String,
    pub count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_scale: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<u32>,
}

impl NodePoolUpdateRequest {
    pub fn new(name: impl Into<String>, count: u32) -> Self {
        Self {
            name: name.into(),
            count,
            ..Default::default()
        }
    }
}

/// Body of `POST /v2/kubernetes/clusters`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClusterCreateRequest {
    pub name: String,
    pub region: String,
    /// A version slug, or `latest`.
    pub version: String,
    /// Empty: the region's default VPC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpc_uuid: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// At least one, with at least one node in all.
    pub node_pools: Vec<NodePoolCreateRequest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maintenance_policy: Option<MaintenancePolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_upgrade: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub surge_upgrade: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ha: Option<bool>,
}

/// A load balancer forwarding rule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForwardingRule {
    pub entry_protocol: String,
    pub entry_port: u32,
    pub target_protocol: String,
    pub target_port: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub certificate_id: String,
    pub tls_passthrough: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionRef {
    pub slug: String,
    pub name: String,
}

/// A load balancer (DOKS creates them for LoadBalancer Services).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadBalancer {
    pub id: String,
    pub name: String,
    /// Empty until the load balancer is active.
    #[serde(deserialize_with = "null_as_default")]
    pub ip: String,
    /// `new`, `active` or `errored`.
    pub status: String,
    pub vpc_uuid: String,
    /// `EXTERNAL` or `INTERNAL`.
    #[serde(deserialize_with = "null_as_default")]
    pub network: String,
    /// `REGIONAL`, `REGIONAL_NETWORK` or `GLOBAL`.
    #[serde(rename = "type", deserialize_with = "null_as_default")]
    pub lb_type: String,
    /// DOKS sets `k8s:<cluster id>`.
    #[serde(deserialize_with = "null_as_default")]
    pub tag: String,
    #[serde(deserialize_with = "null_as_default")]
    pub forwarding_rules: Vec<ForwardingRule>,
    pub region: Option<RegionRef>,
    pub created_at: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_parse_and_never_show_the_token() {
        // As DigitalOcean's own example writes it: a space for the `T`.
        let c = ClusterCredentials::from_body(
            br#"{"server":"https://k.example","certificate_authority_data":"TFMw","client_certificate_data":null,"client_key_data":null,"token":"tok_secret_value","expires_at":"2019-11-09 11:50:28.889080+00:00"}"#,
        )
        .unwrap();
        assert_eq!(c.token, "tok_secret_value");
        assert_eq!(c.certificate_authority_data, "TFMw");
        assert_eq!(
            c.expires_at.unwrap().to_rfc3339(),
            "2019-11-09T11:50:28.889080+00:00"
        );
        assert!(!format!("{c:?}").contains("secret_value"));
        let z = ClusterCredentials::from_body(
            br#"{"server":"https://k","token":"t","expires_at":"2026-01-01T00:00:00.5Z"}"#,
        )
        .unwrap();
        assert_eq!(z.expires_at.unwrap().timestamp_millis() % 1000, 500);
        assert_eq!(z.certificate_authority_data, "");
        let none = ClusterCredentials::from_body(br#"{"server":"https://k","token":"t"}"#).unwrap();
        assert_eq!(none.expires_at, None);
        // Errors name what is wrong without echoing the body.
        for bad in [
            &br#"{"server":"https://k","token":42,"x":"tok_secret_value"}"#[..],
            br#"{"server":"https://k","token":"tok_secret_value","expires_at":"soon"}"#,
            br#"{"server":"https://k","token":""}"#,
        ] {
            let e = ClusterCredentials::from_body(bad).unwrap_err();
            assert!(!e.contains("secret_value"), "{e}");
        }
    }

    #[test]
    fn pool_with_null_labels_reads_as_empty() {
        let p: NodePool = serde_json::from_str(
            r#"{"id":"p","name":"n","size":"s-1vcpu-2gb","count":1,"labels":null,"taints":[],"nodes":[{"id":"x","name":"n-abcde","status":{"state":"running"}}]}"#,
        )
        .unwrap();
        assert!(p.labels.is_empty());
        assert_eq!(p.running_nodes(), 1);
        let n: Node = serde_json::from_str(r#"{"status":{"state":"something-new"}}"#).unwrap();
        assert_eq!(n.status.state, NodeState::Unknown);
    }
}

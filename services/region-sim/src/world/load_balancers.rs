//! Load balancers the clusters' cloud controller makes for Services of type LoadBalancer (as
//! DOKS's does): an address of their own each, given back when the Service goes.

use super::*;

impl World {
    pub(super) fn lb_json(&self, l: &LoadBalancer) -> Value {
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
}

//! DOKS clusters, their node pools and nodes (`/v2/kubernetes/clusters`), as DigitalOcean's API
//! serves them: pools validated as the real API validates them, GPU capacity shared by the
//! region, nodes that take time to join, scale-downs and deletions that remove nodes.

use super::*;

impl World {
    /// Nodes of `slug` that occupy hardware, excluding pool `except` (whose share is recomputed).
    pub(super) fn used(st: &State, slug: &str, except: Option<&str>) -> u32 {
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
}

//! A simulated Kubernetes API server, the stand-in for a DOKS cluster in the
//! region simulator and in tests. It owns an in-memory object store served over
//! plain HTTP on loopback ([`Cluster::start`]), or to callers in the same process
//! without any socket ([`Cluster::start_in_process`] and [`Cluster::call`]: the
//! region simulator, which serves thousands of clusters behind one listener of
//! its own), in the shape kube-rs and kubectl expect (discovery,
//! get/list/watch, create/replace/patch/server-side apply, delete with
//! finalizers and cascading), plus the small simulated world behind it: a
//! scheduler and Deployment controller that place pods on GPU nodes, load
//! balancer and Gateway addresses, route and InferencePool status. Whether a
//! pod's containers load is the answer of an optional hook ([`ModelLoader`],
//! told each container's args and resolved environment): without one, bound
//! pods turn Ready after the model-load delay; with one, a failed load
//! crash-loops as on a real kubelet. What a pod answers on its ports, through the API's
//! `pods/proxy` subresource, is likewise the answer of an optional hook ([`PodProxy`]). It must not
//! open connections to anything, pretend to run containers or serve data-plane
//! traffic (another crate wires that), or know about DigitalOcean's API beyond
//! the node labels, taints and Service annotations a real cluster carries.

mod controllers;
mod discovery;
mod error;
mod http;
mod loader;
mod managed;
mod ops;
mod patch;
mod pod_proxy;
mod resources;
mod selector;
mod store;
mod validation;
mod watch;

/// The hook deciding whether a container's model loads (see [`ClusterConfig::model_loader`]).
pub use loader::{LoadRequest, ModelLoader};
/// The hook answering the `pods/proxy` subresource (see [`ClusterConfig::pod_proxy`]).
pub use pod_proxy::{PodProxy, ProxyRequest, ProxyResponse};
/// Label selectors as the API server matches them (NetworkPolicy peers use them too).
pub use selector::LabelSelector;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::managed::Scope;
use crate::store::{Key, Store};

/// Timing and access settings of a simulated cluster.
#[derive(Clone)]
pub struct ClusterConfig {
    /// How long a scheduled pod that asks for GPUs takes to turn Ready (the model download and
    /// load), and how long a restarted container takes again; other pods take at most a second.
    pub model_load_delay: Duration,
    /// How long a LoadBalancer Service waits for `status.loadBalancer.ingress`.
    pub lb_address_delay: Duration,
    /// How long a Gateway waits before it is Programmed with an address.
    pub gateway_address_delay: Duration,
    /// When set, every request must carry `Authorization: Bearer <token>`.
    pub bearer_token: Option<String>,
    /// Asked, once the model-load delay has passed, whether each container of a bound pod
    /// started: `None` turns every pod Ready after the delay. A container whose load fails
    /// crash-loops as on a real kubelet: it waits in `CrashLoopBackOff` with the loader's
    /// message as its last termination message, restarts after a back-off doubling from 1 s to
    /// 10 s, and is asked again with its new restart count.
    pub model_loader: Option<Arc<dyn ModelLoader>>,
    /// Answers `GET /api/v1/namespaces/{ns}/pods/{name}[:{port}]/proxy/{path}` for a pod that
    /// is Running and Ready, as the real API server forwards such a request to the pod (how an
    /// autoscaler outside the pods' network reads their `/metrics`). The cluster runs no
    /// containers, so without a hook, or when the hook has no answer, the request is 503
    /// ("error trying to reach service"), as for a pod where nothing listens.
    pub pod_proxy: Option<Arc<dyn PodProxy>>,
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("model_load_delay", &self.model_load_delay)
            .field("lb_address_delay", &self.lb_address_delay)
            .field("gateway_address_delay", &self.gateway_address_delay)
            .field(
                "bearer_token",
                &self.bearer_token.as_ref().map(|_| "<redacted>"),
            )
            .field(
                "model_loader",
                &self.model_loader.as_ref().map(|_| "<loader>"),
            )
            .field("pod_proxy", &self.pod_proxy.as_ref().map(|_| "<proxy>"))
            .finish()
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            model_load_delay: Duration::from_millis(200),
            lb_address_delay: Duration::from_millis(100),
            gateway_address_delay: Duration::from_millis(100),
            bearer_token: None,
            model_loader: None,
            pod_proxy: None,
        }
    }
}

/// State shared by the HTTP handlers, the controllers and [`Cluster`] handles.
pub(crate) struct Shared {
    name: String,
    store: Arc<Store>,
    config: Mutex<ClusterConfig>,
    shutdown: tokio::sync::watch::Sender<bool>,
    /// Passes the controllers have made (see [`Cluster::controller_passes`]).
    passes: std::sync::atomic::AtomicU64,
}

impl Shared {
    pub(crate) fn config(&self) -> ClusterConfig {
        self.config
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    pub(crate) fn shutdown_rx(&self) -> tokio::sync::watch::Receiver<bool> {
        self.shutdown.subscribe()
    }
}

struct Running {
    shared: Arc<Shared>,
    /// Where it listens; `None` for a cluster served in process only.
    addr: Option<std::net::SocketAddr>,
    /// The API, for in-process calls.
    router: axum::Router,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Drop for Running {
    /// The last [`Cluster`] handle going away stops the server and controllers,
    /// so a simulator that forgets a cluster does not leak its tasks.
    fn drop(&mut self) {
        let _ = self.shared.shutdown.send(true);
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

/// A running simulated cluster. Cheap to clone; every clone drives the same cluster.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Running>,
}

/// The field manager recorded for writes made through [`Cluster`] methods.
const SIM_MANAGER: &str = "sim-kube";

impl Cluster {
    /// Binds `127.0.0.1:0`, serves the API and starts the built-in controllers.
    /// Namespaces `default`, `kube-system`, `kube-public` and `kube-node-lease` exist from the start.
    pub async fn start(name: &str, config: ClusterConfig) -> anyhow::Result<Cluster> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the simulated API server")?;
        let addr = listener.local_addr()?;
        let shared = Self::new_shared(name, config)?;
        let app = http::router(shared.clone());
        let mut stop = shared.shutdown_rx();
        let server = tokio::spawn({
            let app = app.clone();
            async move {
                let graceful = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(graceful)
                    .await
                {
                    tracing::warn!(error = %e, "simulated API server stopped");
                }
            }
        });
        let controllers = tokio::spawn(controllers::run(shared.clone()));
        tracing::info!(cluster = name, %addr, "simulated Kubernetes API server started");
        Ok(Cluster {
            inner: Arc::new(Running {
                shared,
                addr: Some(addr),
                router: app,
                tasks: Mutex::new(vec![server, controllers]),
            }),
        })
    }

    /// As [`Cluster::start`], but without a listener: the API is reached only through
    /// [`Cluster::call`], from this process, and the cluster holds no socket at all. Must be
    /// called within a Tokio runtime (the controllers run on it).
    pub fn start_in_process(name: &str, config: ClusterConfig) -> anyhow::Result<Cluster> {
        let shared = Self::new_shared(name, config)?;
        let app = http::router(shared.clone());
        let controllers = tokio::spawn(controllers::run(shared.clone()));
        tracing::debug!(
            cluster = name,
            "simulated Kubernetes API server started in process"
        );
        Ok(Cluster {
            inner: Arc::new(Running {
                shared,
                addr: None,
                router: app,
                tasks: Mutex::new(vec![controllers]),
            }),
        })
    }

    /// The store with its initial namespaces, and the shutdown signal.
    fn new_shared(name: &str, config: ClusterConfig) -> anyhow::Result<Arc<Shared>> {
        let (shutdown, _) = tokio::sync::watch::channel(false);
        let shared = Arc::new(Shared {
            name: name.to_string(),
            store: Arc::new(Store::new()),
            config: Mutex::new(config),
            shutdown,
            passes: std::sync::atomic::AtomicU64::new(0),
        });
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            ops::create(
                &shared.store,
                resources::NAMESPACE,
                None,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
                &ops::Writer::new(SIM_MANAGER),
            )
            .map_err(|e| anyhow::anyhow!(e.message))?;
        }
        Ok(shared)
    }

    /// Serves one API request in process, exactly as the HTTP listener would (same paths,
    /// verbs, status codes and bodies; a watch's body streams its events). The request's
    /// `Authorization` is checked against [`ClusterConfig::bearer_token`] as over HTTP.
    pub async fn call(
        &self,
        req: ::http::Request<axum::body::Body>,
    ) -> ::http::Response<axum::body::Body> {
        use tower::ServiceExt;
        match self.inner.router.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        }
    }

    fn store(&self) -> &Store {
        &self.inner.shared.store
    }

    /// The cluster's name (used in the kubeconfig).
    pub fn name(&self) -> &str {
        &self.inner.shared.name
    }

    /// `http://127.0.0.1:PORT`.
    ///
    /// # Panics
    ///
    /// For a cluster started with [`Cluster::start_in_process`], which has no address.
    pub fn url(&self) -> String {
        let addr = self
            .inner
            .addr
            .expect("a cluster started in process has no URL: use Cluster::call");
        format!("http://{addr}")
    }

    /// Where it listens; `None` for a cluster started in process.
    pub fn addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.addr
    }

    /// A kubeconfig for this cluster: server = [`Cluster::url`], a token user
    /// when the cluster requires one. Panics as [`Cluster::url`] does.
    pub fn kubeconfig_yaml(&self) -> String {
        let name = self.name();
        let user = match &self.inner.shared.config().bearer_token {
            Some(t) => format!(
                "  user:\n    token: {}\n",
                serde_json::to_string(t).expect("json string")
            ),
            None => "  user: {}\n".to_string(),
        };
        // JSON strings are valid YAML scalars, whatever the cluster is called.
        let user_name = serde_json::to_string(&format!("{name}-admin")).expect("json string");
        let name = serde_json::to_string(name).expect("json string");
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: {url}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    user: {user_name}\n    namespace: default\ncurrent-context: {name}\npreferences: {{}}\nusers:\n- name: {user_name}\n{user}",
            url = self.url()
        )
    }

    /// Creates or replaces a Node (the DigitalOcean side calls this when node
    /// pools change). Missing pieces are filled in: Ready condition, allocatable
    /// equal to capacity, a pod capacity, an internal address.
    pub fn upsert_node(&self, mut node: Value) {
        if !node.is_object() {
            return;
        }
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        let name = node["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            tracing::warn!("upsert_node without metadata.name ignored");
            return;
        }
        controllers::complete_node(&mut node, self.store().next_seq());
        let rt = resources::index_of("Node");
        let key = Key::new(rt, "", &name);
        let writer = ops::Writer::new(SIM_MANAGER);
        let exists = self.store().lock().get(&key).is_some();
        let result = if exists {
            let status = node.get("status").cloned();
            let r = ops::replace(
                self.store(),
                rt,
                None,
                &name,
                node,
                Scope::for_main(&resources::TYPES[rt]),
                &writer,
            );
            if let (Ok(_), Some(status)) = (&r, status) {
                ops::mutate(self.store(), &key, Scope::Status, SIM_MANAGER, |n| {
                    // Keep the address the node was first given.
                    let addresses = n["status"]["addresses"].clone();
                    n["status"] = status;
                    if !addresses.is_null() {
                        n["status"]["addresses"] = addresses;
                    }
                });
            }
            r
        } else {
            ops::create(self.store(), rt, None, node, &writer)
        };
        if let Err(e) = result {
            tracing::warn!(node = name, error = %e.message, "upsert_node rejected");
        }
    }

    /// Deletes a Node; its pods are deleted and their controllers recreate them.
    pub fn delete_node(&self, name: &str) {
        let _ = ops::delete(
            self.store(),
            resources::index_of("Node"),
            None,
            name,
            &ops::DeleteOptions::default(),
        );
    }

    /// Every stored object (inventory for leak checks).
    pub fn list_all(&self) -> Vec<Value> {
        self.store().all()
    }

    /// Every stored object, shared rather than copied: for readers that look at the whole
    /// cluster on every change (the region's cloud controller).
    pub fn snapshot(&self) -> Vec<Arc<Value>> {
        self.store()
            .lock()
            .objects
            .values()
            .map(|o| o.value())
            .collect()
    }

    pub fn get(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let rt = resources::by_kind(api_version, kind)?;
        self.store()
            .lock()
            .get(&Key::new(rt, namespace.unwrap_or(""), name))
            .map(Arc::unwrap_or_clone)
    }

    /// Objects of one kind, in one namespace or (None) in all.
    pub fn list(&self, api_version: &str, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        let Some(rt) = resources::by_kind(api_version, kind) else {
            return Vec::new();
        };
        self.store()
            .lock()
            .list(rt, namespace)
            .map(Arc::unwrap_or_clone)
            .collect()
    }

    /// Merge-patches the status of an object directly, the way a component
    /// writing `/status` would (e.g. the data-plane wiring replacing a load
    /// balancer address). Not counted by [`Cluster::write_count`]. Returns
    /// whether the object exists.
    pub fn merge_status(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        patch: Value,
    ) -> bool {
        let Some(rt) = resources::by_kind(api_version, kind) else {
            return false;
        };
        let key = Key::new(rt, namespace.unwrap_or(""), name);
        if self.store().lock().get(&key).is_none() {
            return false;
        }
        ops::mutate(self.store(), &key, Scope::Status, SIM_MANAGER, |o| {
            patch::merge_patch(&mut o["status"], &patch);
        });
        true
    }

    /// Fires the new resourceVersion on every change.
    pub fn subscribe(&self) -> broadcast::Receiver<u64> {
        self.store().subscribe_versions()
    }

    /// Changes the delays (and token) at run time.
    pub fn set_config(&self, config: ClusterConfig) {
        *self
            .inner
            .shared
            .config
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = config;
        self.store().notify.notify_one();
    }

    pub fn config(&self) -> ClusterConfig {
        self.inner.shared.config()
    }

    /// Mutating API requests that changed something. Writes by the built-in
    /// controllers and by [`Cluster`] methods are not counted.
    pub fn write_count(&self) -> u64 {
        self.store().write_count()
    }

    /// Passes the built-in controllers have made over the objects: one after every burst of
    /// changes and whenever a timer of theirs is due (a pod's model load, a back-off, an
    /// address delay); none for a cluster where nothing changes, however long it runs.
    pub fn controller_passes(&self) -> u64 {
        self.inner
            .shared
            .passes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The current (highest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.store().lock().rv
    }

    /// Forgets the watch history: watches resuming from any earlier
    /// resourceVersion get 410 Gone and must re-list.
    pub fn compact_history(&self) {
        self.store().compact();
    }

    /// Stops serving, ends open watches and stops the controllers.
    pub async fn shutdown(&self) {
        let _ = self.inner.shared.shutdown.send(true);
        let tasks: Vec<_> =
            std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for t in tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), t)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }
}

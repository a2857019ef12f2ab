//! The hook that decides whether a container's start-up work (for a model server: downloading
//! and loading its model) succeeds. The cluster knows nothing of models: it hands the hook what
//! a container would see when it starts (its args and its resolved environment) and shows the
//! answer the way a kubelet would, Ready or crash-looping.

use std::collections::BTreeMap;

/// What a container starts with, as a [`ModelLoader`] is asked about it: once the model-load
/// delay has passed after the container (re)started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadRequest {
    /// `metadata.uid` of the pod: with `restart_count`, it names one attempt.
    pub pod_uid: String,
    pub namespace: String,
    pub pod_name: String,
    /// The container's name (`vllm`).
    pub container: String,
    /// The container's `args`, as the pod spec has them.
    pub args: Vec<String>,
    /// The container's `env` resolved as the kubelet resolves it: plain `value`s, and
    /// `valueFrom.secretKeyRef` read from the namespace's Secret and base64-decoded. A variable
    /// whose Secret or key does not exist is left out; a later entry of one name wins.
    pub env: BTreeMap<String, String>,
    /// How often the container has been restarted so far (0 on the first attempt).
    pub restart_count: u32,
}

impl LoadRequest {
    /// The value following `flag` in the args (`--model org/name`), or of `flag=value`.
    pub fn arg(&self, flag: &str) -> Option<&str> {
        let mut args = self.args.iter();
        while let Some(a) = args.next() {
            if a == flag {
                return args.next().map(String::as_str);
            }
            if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                return Some(v);
            }
        }
        None
    }
}

/// Decides how a container's start-up ends. Called from the cluster's controller loop, so it
/// must answer at once: slow work (a download) runs elsewhere, and the answer is `None` until
/// it is known; the cluster asks again on a later pass.
pub trait ModelLoader: Send + Sync {
    /// `None`: not known yet, ask again later. `Some(Ok(()))`: loaded, the container turns
    /// ready. `Some(Err(message))`: the container exits with code 1 and `message` as its
    /// termination message, and is restarted after a back-off (then asked again with the next
    /// `restart_count`).
    fn load(&self, request: &LoadRequest) -> Option<Result<(), String>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_by_flag() {
        let r = LoadRequest {
            pod_uid: "u".into(),
            namespace: "ns".into(),
            pod_name: "p".into(),
            container: "vllm".into(),
            args: ["--model", "org/m", "--revision=v2", "--port"]
                .map(String::from)
                .to_vec(),
            env: BTreeMap::new(),
            restart_count: 0,
        };
        assert_eq!(r.arg("--model"), Some("org/m"));
        assert_eq!(r.arg("--revision"), Some("v2"));
        assert_eq!(r.arg("--port"), None);
        assert_eq!(r.arg("--served-model-name"), None);
    }
}

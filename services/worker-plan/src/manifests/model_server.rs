//! The model server of each model deployment: its vLLM Deployment (one whole-node pod per
//! replica, its GPUs sharing the model) and the labels that select its pods.

use serde_json::{json, Value};
use uuid::Uuid;

use super::{json_hash, labels_of, meta, ManifestInput, VLLM_PORT};
use crate::model::{GpuVendor, Model};
use crate::names;

/// The InferencePool selector of a model deployment, also its vLLM pods' labels.
pub fn pool_selector(model_id: &Uuid) -> Value {
    json!({
        names::SERVING_LABEL: "true",
        names::MODEL_LABEL: names::model_label(model_id),
    })
}

pub(super) fn vllm_deployment(input: &ManifestInput, m: &Model) -> Value {
    let di = &input.di_id;
    let name = names::vllm_deployment(&m.model_id);
    let pool = names::node_pool(di, &m.model_id, &m.accelerator_slug);
    let gpu = m.vendor.resource_name();
    let image = match m.vendor {
        GpuVendor::Nvidia => &input.images.vllm_nvidia,
        GpuVendor::Amd => &input.images.vllm_amd,
    };
    let model_extra = [(names::MODEL_ID_LABEL, m.model_id.to_string())];
    let mut pod_labels = labels_of(di, &model_extra);
    for (k, v) in pool_selector(&m.model_id).as_object().expect("object") {
        pod_labels[k] = v.clone();
    }
    pod_labels["llm-d.ai/role"] = json!("decode");
    pod_labels["llm-d.ai/engine-type"] = json!("vllm");
    let mut env = Vec::new();
    if let Some(hub) = &input.hub_endpoint {
        env.push(json!({"name": "HF_ENDPOINT", "value": hub}));
    }
    if input.hugging_face_token.is_some() {
        env.push(json!({
            "name": names::HF_TOKEN_KEY,
            "valueFrom": {"secretKeyRef": {"name": names::HF_TOKEN_SECRET, "key": names::HF_TOKEN_KEY}},
        }));
    }
    let probe = |period: u32, failures: u32| {
        json!({
            "httpGet": {"path": "/health", "port": VLLM_PORT},
            "periodSeconds": period,
            "failureThreshold": failures,
        })
    };
    let gpus = m.gpus_per_node.to_string();
    let mut args = vec![json!("--model"), json!(m.repository)];
    if let Some(revision) = &m.revision {
        args.extend([json!("--revision"), json!(revision)]);
    }
    args.extend([
        json!("--served-model-name"),
        json!(m.model_slug),
        json!("--port"),
        json!(VLLM_PORT.to_string()),
        json!("--enable-prefix-caching"),
        // One model server per node, its GPUs sharing the model.
        json!("--tensor-parallel-size"),
        json!(gpus),
    ]);
    let mut container = json!({
        "name": "vllm",
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}],
        "resources": {"limits": {gpu: gpus}, "requests": {gpu: gpus}},
        // vLLM writes no termination log: a failed model load (a repository gone, a token
        // revoked) reaches the pod's status, and so the DI's error, through the log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        // Model download and load can take many minutes: the startup probe allows 30.
        "startupProbe": probe(10, 180),
        "readinessProbe": probe(5, 3),
        "livenessProbe": probe(10, 6),
        // Let the endpoint picker stop choosing this pod before vLLM stops.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "30"]}}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    });
    if !env.is_empty() {
        container["env"] = Value::Array(env);
    }
    let mut template = json!({
        "metadata": {"labels": pod_labels},
        "spec": {
            "nodeSelector": {names::NODE_POOL_LABEL: pool},
            "tolerations": [{"key": gpu, "operator": "Exists", "effect": "NoSchedule"}],
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 130,
            "containers": [container],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    });
    let hash = json_hash(&template);
    template["metadata"]["annotations"] = json!({names::TEMPLATE_HASH_ANNOTATION: hash});
    let mut metadata = meta(di, &name, &model_extra);
    metadata["annotations"] = json!({names::TEMPLATE_HASH_ANNOTATION: hash});
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": m.scale,
            "selector": {"matchLabels": pool_selector(&m.model_id)},
            // Zero downtime on whole-node pods: a new pod must be ready before an old one goes
            // (maxUnavailable 0), one at a time (maxSurge 1). The node pool planner adds the
            // one spare node the surge pod needs while the rollout lasts.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": 3600,
            "template": template,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::manifests;
    use crate::manifests::tests::{decode, di, find, input, one, two, M1};
    use crate::model::tests::deployment;

    #[test]
    fn vllm_deployment_shape() {
        let objs = manifests(&one());
        let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert!(c["image"]
            .as_str()
            .unwrap()
            .starts_with("vllm/vllm-openai:v"));
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let m = "meta-llama/Llama-3.1-8B-Instruct";
        assert_eq!(
            args,
            [
                "--model",
                m,
                "--served-model-name",
                m,
                "--port",
                "8000",
                "--enable-prefix-caching",
                "--tensor-parallel-size",
                "8"
            ]
        );
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
        assert_eq!(c["terminationMessagePolicy"], "FallbackToLogsOnError");
        assert_eq!(c["ports"][0]["containerPort"], 8000);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
        assert_eq!(c["volumeMounts"][0]["mountPath"], "/dev/shm");
        assert_eq!(pod["volumes"][0]["emptyDir"]["medium"], "Memory");
        assert_eq!(
            pod["nodeSelector"][names::NODE_POOL_LABEL],
            names::node_pool(&di(), &M1.parse().unwrap(), "gpu-h100x8-640gb")
        );
        assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
        assert_eq!(d["spec"]["replicas"], 2);
        assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 1);
        assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
        let sel = &d["spec"]["selector"]["matchLabels"];
        assert_eq!(sel, &pool_selector(&M1.parse().unwrap()));
        for (k, v) in sel.as_object().unwrap() {
            assert_eq!(&d["spec"]["template"]["metadata"]["labels"][k], v);
        }
        assert!(c.get("env").is_none(), "no HF token, no env");
    }

    #[test]
    fn a_customers_repository_is_loaded_and_served_under_its_name() {
        let mut d = deployment(M1, "support-bot", "gpu-h100x8-640gb", 1);
        d.source = api_types::spec::ModelSource {
            repository: "my-org/my-finetune".into(),
            revision: Some("v2".into()),
            custom: true,
            // Stored before commits were pinned: the revision as named.
            commit: None,
        };
        // Workload hints are typical lengths, not limits: no --max-model-len from them.
        d.workload_config = json!({"input_tokens": 3500, "output_tokens": 500});
        let mut i = input(&[d], true);
        i.hub_endpoint = Some("http://hub.test".into());
        let objs = manifests(&i);
        let c = &find(&objs, "Deployment", "vllm-aaaaaaaa")["spec"]["template"]["spec"]
            ["containers"][0];
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--model",
                "my-org/my-finetune",
                "--revision",
                "v2",
                "--served-model-name",
                "support-bot",
                "--port",
                "8000",
                "--enable-prefix-caching",
                "--tensor-parallel-size",
                "8"
            ]
        );
        assert_eq!(
            c["env"],
            json!([{"name": "HF_ENDPOINT", "value": "http://hub.test"}])
        );
    }

    /// A pinned commit is what vLLM loads, not the branch it was read from: a replica that
    /// starts after the branch moved loads what its siblings do. Without one (a spec stored
    /// before commits were pinned) the revision as named, exactly as before.
    #[test]
    fn a_pinned_commit_is_the_revision_loaded() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let vllm_args = |source: api_types::spec::ModelSource| {
            let mut d = deployment(M1, "support-bot", "gpu-h100x1-80gb", 1);
            d.source = source;
            let objs = manifests(&input(&[d], true));
            let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
            let args: Vec<String> = d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect();
            (
                args,
                d["spec"]["template"]["metadata"]["annotations"].clone(),
            )
        };
        let branch = api_types::spec::ModelSource {
            repository: "my-org/my-finetune".into(),
            revision: Some("main".into()),
            custom: true,
            commit: None,
        };
        let pinned = api_types::spec::ModelSource {
            commit: Some(commit.into()),
            ..branch.clone()
        };
        let (args, unpinned_hash) = vllm_args(branch.clone());
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", "main"]
        );
        let (args, pinned_hash) = vllm_args(pinned.clone());
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", commit]
        );
        assert_eq!(args.iter().filter(|a| *a == "--revision").count(), 1);
        // The default branch, pinned: the commit too.
        let (args, _) = vllm_args(api_types::spec::ModelSource {
            revision: None,
            ..pinned
        });
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", commit]
        );
        // Pinning changes the pod template (a rollout); an unpinned spec renders as before.
        assert_ne!(unpinned_hash, pinned_hash);
        assert_eq!(vllm_args(branch).1, unpinned_hash);
    }

    #[test]
    fn gated_model_gets_hf_token_env_and_secret() {
        let mut i = one();
        i.hugging_face_token = Some("hf_secret".into());
        let objs = manifests(&i);
        let s = find(&objs, "Secret", "hf-token");
        assert_eq!(decode(&s["data"]["HF_TOKEN"]), "hf_secret");
        let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
        let env = &d["spec"]["template"]["spec"]["containers"][0]["env"][0];
        assert_eq!(env["name"], "HF_TOKEN");
        assert_eq!(env["valueFrom"]["secretKeyRef"]["name"], "hf-token");
        assert_eq!(env["valueFrom"]["secretKeyRef"]["key"], "HF_TOKEN");
        assert!(!manifests(&one())
            .iter()
            .any(|o| o["metadata"]["name"] == "hf-token"));
        // Adding the token changes the pod template: the template hash follows.
        let hash = |objs: &[Value]| {
            find(objs, "Deployment", "vllm-aaaaaaaa")["metadata"]["annotations"]
                [names::TEMPLATE_HASH_ANNOTATION]
                .clone()
        };
        assert_ne!(hash(&objs), hash(&manifests(&one())));
    }

    #[test]
    fn scale_change_keeps_template_hash() {
        let a = manifests(&one());
        let mut i = one();
        i.models[0].scale = 5;
        let b = manifests(&i);
        let get = |objs: &[Value]| find(objs, "Deployment", "vllm-aaaaaaaa").clone();
        assert_eq!(get(&b)["spec"]["replicas"], 5);
        assert_eq!(
            get(&a)["metadata"]["annotations"],
            get(&b)["metadata"]["annotations"]
        );
    }

    #[test]
    fn amd_model_uses_amd_resource_toleration_and_image() {
        let objs = manifests(&two());
        let d = find(&objs, "Deployment", "vllm-bbbbbbbb");
        let pod = &d["spec"]["template"]["spec"];
        assert_eq!(
            pod["containers"][0]["resources"]["limits"]["amd.com/gpu"],
            "1"
        );
        assert!(pod["containers"][0]["resources"]["limits"]
            .get("nvidia.com/gpu")
            .is_none());
        assert_eq!(pod["tolerations"][0]["key"], "amd.com/gpu");
        assert!(pod["containers"][0]["image"]
            .as_str()
            .unwrap()
            .contains("rocm"));
    }
}

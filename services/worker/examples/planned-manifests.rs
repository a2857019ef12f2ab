//! Prints every Kubernetes object the worker plans for two representative DIs (one model,
//! public, gated, NVIDIA; two models, private, NVIDIA and AMD) as a YAML stream, so that
//! `scripts/validate-planned` can check them against the Kubernetes API schemas.

use api_types::spec::{AcceleratorGroup, ModelDeployment};
use uuid::Uuid;
use worker::plan::{self, AccessTokenHash, ManifestInput, TlsPair};

fn deployment(id: u128, slug: &str, accelerator: &str, scale: i32) -> ModelDeployment {
    ModelDeployment {
        model_id: Some(Uuid::from_u128(id)),
        model_slug: slug.into(),
        model_provider: "hugging_face".into(),
        provider_model_id: String::new(),
        source: api_types::spec::ModelSource::default(),
        workload_config: serde_json::json!({}),
        accelerators: vec![AcceleratorGroup {
            accelerator_slug: accelerator.into(),
            role: "prefill_decode".into(),
            scale,
        }],
    }
}

fn main() {
    // Placeholders: the schemas check the Secret's shape, not what the PEM says.
    let tls = TlsPair {
        cert_pem: "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n".into(),
        key_pem: "-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n".into(),
    };
    let one = [deployment(
        0xaaaa_0001 << 96,
        "meta-llama/Llama-3.1-8B-Instruct",
        "gpu-h100x8-640gb",
        2,
    )];
    let two = [
        deployment(0xbbbb_0001 << 96, "org/first", "gpu-h100x1-80gb", 1),
        deployment(0xcccc_0002 << 96, "org/second", "gpu-mi300x1-192gb", 3),
    ];
    let mut out = String::new();
    for (n, (mds, public)) in [(&one[..], true), (&two[..], false)]
        .into_iter()
        .enumerate()
    {
        let di = Uuid::from_u128(0xd1 + n as u128);
        let models = plan::models(mds).expect("valid deployments");
        let mut input = ManifestInput::new(di, models, public, tls.clone());
        input.access_tokens = vec![AccessTokenHash::from_value(Uuid::from_u128(1), "token")];
        if public {
            input.hugging_face_token = Some("hf_placeholder".into());
        }
        for obj in plan::manifests(&input) {
            // JSON is YAML: one document per object.
            out.push_str("---\n");
            out.push_str(&serde_json::to_string_pretty(&obj).expect("JSON"));
            out.push('\n');
        }
    }
    print!("{out}");
}

//! The normalised desired state of a dedicated inference, as central sends it to a region and as
//! the region stores it (one immutable row set per version).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Spec {
    pub version: i32,
    pub name: String,
    pub region: String,
    /// `None` when the request names no VPC: on a create the team's default VPC in the region
    /// (the regional service fills it in before storing), on a patch the DI's own.
    pub vpc_uuid: Option<Uuid>,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeployment>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelDeployment {
    /// `None` on input means "a new deployment"; the region assigns an id.
    pub model_id: Option<Uuid>,
    /// The name clients call the model by (`model` in requests, `/v1/models`): the catalog
    /// model's slug, or for a customer's own repository the `model_slug` sent, else its id.
    pub model_slug: String,
    /// `modelcatalog` or `hugging_face`, as sent.
    pub model_provider: String,
    /// The provider's model id as sent, `""` when none (godo always sends the field).
    #[serde(default)]
    pub provider_model_id: String,
    /// What the model server loads.
    #[serde(default)]
    pub source: ModelSource,
    #[schema(value_type = Object)]
    pub workload_config: serde_json::Value,
    pub accelerators: Vec<AcceleratorGroup>,
}

/// A Hugging Face repository at a revision: what a model server loads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ModelSource {
    pub repository: String,
    /// A branch, tag or commit; `None` is the repository's default branch.
    pub revision: Option<String>,
    /// The customer's own choice (`hugging_face` with a `provider_model_id`), which the region
    /// checks against the Hub; `false` for a catalog model.
    pub custom: bool,
    /// The commit (40 hex) the Hub reported for `revision` when the region accepted it: what
    /// every replica loads, so that one started next week loads the weights its siblings do.
    /// Only the region sets it, and keeps it while a PATCH names the same repository and
    /// revision. Absent for catalog models and for deployments stored before commits were
    /// pinned, which load `revision` as it is when they start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

impl ModelSource {
    /// The revision a model server loads (`--revision`): the pinned commit, else the revision
    /// named (`None`: the default branch).
    pub fn loaded_revision(&self) -> Option<&str> {
        self.commit.as_deref().or(self.revision.as_deref())
    }

    /// Whether `self` names what `other` named (the same repository at the same revision, both
    /// a customer's choice or both a catalog model's): then it keeps `other`'s commit. The Hub's
    /// repository ids ignore case; revisions do not.
    pub fn names_the_same(&self, other: &ModelSource) -> bool {
        self.custom == other.custom
            && self.repository.eq_ignore_ascii_case(&other.repository)
            && self.revision == other.revision
    }
}

/// Whether `text` is a full commit id as the Hub gives them (40 hex digits).
pub fn is_commit(text: &str) -> bool {
    text.len() == 40 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What a deployment declares about its workload, in DigitalOcean's slot for workload hints
/// (`model_deployments[].workload_config`). Every part is optional; other keys are kept as sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkloadConfig {
    /// Typical prompt length, tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Typical completion length, tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
}

/// Latency objectives, met at `percentile` of requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Slo {
    /// Time to first token, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Which percentile of requests must meet them (default 90).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentile: Option<f64>,
}

/// Replica bounds: with them, `accelerators[].scale` is the starting replica count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Autoscaling {
    /// Default 1; 0 lets an idle deployment scale to zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<u32>,
    /// Default: the starting `scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_replicas: Option<u32>,
    /// How long without requests before the last replica goes, once `min_replicas` is 0
    /// (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_to_zero_after_seconds: Option<u32>,
}

impl ModelDeployment {
    /// The workload it declares (the known parts of `workload_config`; central has checked
    /// them).
    pub fn workload(&self) -> WorkloadConfig {
        serde_json::from_value(self.workload_config.clone()).unwrap_or_default()
    }

    /// The context a deployment declares in its workload hints (`input_tokens` +
    /// `output_tokens` of `workload_config`), which bounds a sequence's length; `None` when it
    /// declares none, and the model's own maximum applies.
    pub fn declared_context(&self) -> Option<u64> {
        let w = self.workload();
        match (w.input_tokens, w.output_tokens) {
            (Some(i), Some(o)) if i + o > 0 => Some(i.saturating_add(o)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AcceleratorGroup {
    pub accelerator_slug: String,
    /// The accelerator's role, `type` on the public wire (e.g. `prefill_decode`).
    pub role: String,
    pub scale: i32,
}

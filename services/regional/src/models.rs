//! Whether a customer's own Hugging Face repository can be served as declared, asked of the
//! Hugging Face Hub before anything is stored, so that what would fail an hour later in a model
//! server is a `4xx` at once that says what to change:
//!
//! - a `hugging_face_token` the Hub rejects (`whoami`);
//! - a repository that does not exist, or is private and the token cannot read it, or a
//!   revision it does not have (model info);
//! - a gated repository without a token, or with one whose account has no access (reading its
//!   `config.json`, exactly what a model server's download does first);
//! - an architecture the model server (vLLM) does not load (the catalog's list);
//! - weights and KV cache that do not fit the GPUs: the weights at the served precision (from
//!   the Hub's safetensors parameter counts), plus the KV cache of one sequence of the declared
//!   context (vLLM refuses to start when it cannot hold one), plus a fixed overhead per GPU,
//!   within the share of GPU memory vLLM takes (90 %). A size that is too small is answered
//!   with the smallest one in the region that fits.
//!
//! Catalog models are not asked about: the catalog says where they run. Nor is a deployment that
//! a PATCH leaves as it was (same repository, revision, GPU size and context) when the token does
//! not change either: a scale change never waits on the Hub.
//!
//! It also pins what a customer's repository serves: the commit the Hub reports for the
//! revision named (or the default branch) is stored with the deployment, and every model server
//! loads that commit ([`keep_commits`], [`pin_reported`]). A PATCH that names the same repository
//! and revision keeps the commit, wherever the branch has moved since; one that names another
//! revision (the new commit itself, say) asks the Hub again. Catalog models are not pinned.

use std::collections::BTreeMap;
use std::time::Duration;

use api_types::catalog::{Catalog, Size};
use api_types::spec::{is_commit, ModelDeployment};
use cloud_clients::hugging_face::{HubClient, HubClientOptions, HubError, ModelInfo};
use common::errors::{Classify, ErrorClass};

use crate::ApiError;

/// The share of each GPU's memory vLLM allocates (`--gpu-memory-utilization`, default 0.9).
const GPU_MEMORY_UTILIZATION: f64 = 0.9;
/// Per GPU, what neither weights nor KV cache take: activations, CUDA graphs, the runtime.
const OVERHEAD_PER_GPU_GIB: f64 = 1.0;
/// The context sized for when a repository's config names none.
const DEFAULT_CONTEXT: u64 = 4096;
const GIB: f64 = (1u64 << 30) as f64;
/// How long the Hub's answers may take in all: well inside central's wait for the region (5 s
/// by default), so that a slow Hub is a 503 the region gives, with nothing stored.
const CHECK_BUDGET: Duration = Duration::from_millis(3500);

#[derive(Clone, Debug)]
pub struct Models {
    hub: HubClient,
    /// The Hub's address, for the links messages give.
    hub_url: String,
    catalog: Catalog,
    region: String,
}

/// Where a deployment's model comes from, as the Hub describes it.
struct Described {
    info: ModelInfo,
    config: serde_json::Value,
}

impl Models {
    /// Questions to the Hub at `base_url`, retried briefly: the whole answer must arrive well
    /// inside central's wait for the region.
    pub fn new(region: &str, base_url: &str, catalog: Catalog) -> anyhow::Result<Models> {
        let options = HubClientOptions {
            timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(1),
            retry: crate::retry_within_a_request(),
        };
        Ok(Models {
            hub: HubClient::with_options(base_url, options)?,
            hub_url: base_url.trim_end_matches('/').to_string(),
            catalog,
            region: region.to_string(),
        })
    }

    /// Checks, before a create or PATCH is stored: the token, when one is sent or a deployment
    /// is asked about; every deployment of `deployments` that serves a customer's own repository
    /// (all of the above) or a gated catalog model (access with the token), except those
    /// `previous` (the DI's latest spec, on a PATCH) already had unchanged while the token stays
    /// the same (`token_changed` false). `token` is the Hugging Face token the DI will use. A
    /// deployment with a commit is asked about at that commit, what its model servers load.
    ///
    /// Answers, per deployment, the commit the Hub reported for a customer's repository it
    /// asked about (`None` for the others), for [`pin_reported`].
    pub async fn check(
        &self,
        deployments: &[ModelDeployment],
        previous: &[ModelDeployment],
        token: Option<&str>,
        token_changed: bool,
    ) -> Result<Vec<Option<String>>, ApiError> {
        let unchanged = |d: &ModelDeployment| {
            !token_changed
                && previous.iter().any(|q| {
                    q.source.names_the_same(&d.source)
                        && q.declared_context() == d.declared_context()
                        && slugs(q) == slugs(d)
                })
        };
        let gated_catalog_model = |d: &ModelDeployment| {
            !d.source.custom
                && self
                    .catalog
                    .model(&d.model_slug)
                    .is_some_and(|m| m.is_gated_model)
        };
        let to_check: Vec<(usize, &ModelDeployment)> = deployments
            .iter()
            .enumerate()
            .filter(|(_, d)| (d.source.custom || gated_catalog_model(d)) && !unchanged(d))
            .collect();
        let ask = async {
            if let Some(token) = token.filter(|_| token_changed || !to_check.is_empty()) {
                match self.hub.whoami(token).await {
                    Ok(_) => {}
                    Err(HubError::InvalidToken) => return Err(rejected_token()),
                    Err(e) => return Err(unavailable(e)),
                }
            }
            // The deployments at once: the answer must arrive inside central's wait however
            // many there are. The first refusal in spec order is the one reported.
            let answers = futures::future::join_all(
                to_check.iter().map(|(i, d)| self.check_one(*i, d, token)),
            )
            .await;
            let commits = answers
                .into_iter()
                .collect::<Result<Vec<Option<String>>, ApiError>>()?;
            let mut reported = vec![None; deployments.len()];
            for ((i, _), commit) in to_check.iter().zip(commits) {
                reported[*i] = commit;
            }
            Ok(reported)
        };
        match tokio::time::timeout(CHECK_BUDGET, ask).await {
            Ok(answer) => answer,
            Err(_) => Err(ApiError::Unavailable(format!(
                "the Hugging Face Hub did not answer within {CHECK_BUDGET:?}"
            ))),
        }
    }

    /// One deployment's checks; for a customer's repository, the commit the Hub reported.
    async fn check_one(
        &self,
        i: usize,
        d: &ModelDeployment,
        token: Option<&str>,
    ) -> Result<Option<String>, ApiError> {
        let at = format!("spec.model_deployments[{i}]");
        let revision = d.source.loaded_revision();
        if d.source.custom {
            let field = format!("{at}.provider_model_id");
            let info = self.info(&field, d, revision, token).await?;
            let commit = reported_commit(&d.source.repository, &info.sha);
            // The config of the commit pinned, not of the branch: it may move in between.
            let config = self
                .config(&field, d, commit.as_deref().or(revision), token)
                .await?;
            self.fits(&at, d, &Described { info, config })?;
            Ok(commit)
        } else {
            // The catalog says where it runs; whether the token may download it is the Hub's
            // to say.
            self.config(&format!("{at}.model_slug"), d, revision, token)
                .await
                .map(|_| None)
        }
    }

    /// The repository's model info at `revision`: it exists, the token can read it, the
    /// revision is one of its.
    async fn info(
        &self,
        field: &str,
        d: &ModelDeployment,
        revision: Option<&str>,
        token: Option<&str>,
    ) -> Result<ModelInfo, ApiError> {
        let repo = d.source.repository.as_str();
        let refused = |what: String| ApiError::Unprocessable(format!("{field} {what}"));
        match self.hub.model_info(repo, revision, token).await {
            Ok(info) => Ok(info),
            Err(HubError::RepoNotFound) => Err(refused(match token {
                Some(_) => format!("{repo:?} is not a Hugging Face repository the hugging_face_token can read: check the name, or grant the token's account access to the private repository."),
                None => format!("{repo:?} is not a public Hugging Face repository: check the name, or send a hugging_face_token that can read the private repository."),
            })),
            Err(HubError::RevisionNotFound) => Err(refused(format!(
                "{repo:?} has no revision {:?}: name a branch, tag or commit of it.",
                revision.unwrap_or("main")
            ))),
            Err(HubError::InvalidToken) => Err(rejected_token()),
            Err(e) => Err(hub_refused(field, repo, e)),
        }
    }

    /// The repository's `config.json` at `revision`: the model server's first download, where
    /// a gated repository's access shows.
    async fn config(
        &self,
        field: &str,
        d: &ModelDeployment,
        revision: Option<&str>,
        token: Option<&str>,
    ) -> Result<serde_json::Value, ApiError> {
        let repo = d.source.repository.as_str();
        let refused = |what: String| ApiError::Unprocessable(format!("{field} {what}"));
        match self.hub.model_config(repo, revision, token).await {
            Ok(config) => Ok(config),
            Err(HubError::GatedNoAccess { with_token }) => {
                let ask = format!("request access at {}/{repo}", self.hub_url);
                Err(refused(if with_token {
                    format!("{repo:?} is gated and the hugging_face_token's account has no access: {ask}, then retry.")
                } else {
                    format!("{repo:?} is gated: send a hugging_face_token of an account with access ({ask}).")
                }))
            }
            Err(HubError::EntryNotFound) => Err(refused(format!(
                "{repo:?} has no config.json: it is not a model the model server can load."
            ))),
            Err(HubError::RepoNotFound) => Err(refused(match token {
                Some(_) => format!("{repo:?} is not readable with the hugging_face_token."),
                None => format!("{repo:?} is not readable without a hugging_face_token."),
            })),
            Err(HubError::RevisionNotFound) => Err(refused(format!(
                "{repo:?} has no revision {:?}.",
                revision.unwrap_or("main")
            ))),
            Err(HubError::InvalidToken) => Err(rejected_token()),
            Err(e) => Err(hub_refused(field, repo, e)),
        }
    }

    fn fits(&self, at: &str, d: &ModelDeployment, m: &Described) -> Result<(), ApiError> {
        let repo = d.source.repository.as_str();
        let architectures: Vec<String> = if m.info.architectures.is_empty() {
            m.config["architectures"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        } else {
            m.info.architectures.clone()
        };
        let Some(architecture) = architectures.first() else {
            return Err(ApiError::Unprocessable(format!(
                "{at}.provider_model_id {repo:?} names no architecture in its config.json: it is not a model the model server can load."
            )));
        };
        if !self.catalog.serves_architecture(architecture) {
            return Err(ApiError::Unprocessable(format!(
                "{at}.provider_model_id {repo:?} is a {architecture} model, which the model server (vLLM) does not serve; it serves {}.",
                self.catalog.vllm_architectures.join(", ")
            )));
        }
        let need = Need::of(&m.info.safetensors_parameters, &m.config).map_err(|why| {
            ApiError::Unprocessable(format!("{at}.provider_model_id {repo:?} {why}"))
        })?;
        if let Some(max) = need.model_context {
            if let Some(declared) = d.declared_context() {
                if declared > max {
                    return Err(ApiError::Unprocessable(format!(
                        "{at}.workload_config: input_tokens + output_tokens is {declared}, beyond {repo:?}'s context of {max} tokens."
                    )));
                }
            }
        }
        for (j, group) in d.accelerators.iter().enumerate() {
            let Some(size) = self.catalog.size(&group.accelerator_slug) else {
                continue; // central refused it already
            };
            if need.fits(size) {
                continue;
            }
            if !need.splits_over(size.gpu.count) {
                return Err(ApiError::Unprocessable(format!(
                    "{at}.accelerators[{j}].accelerator_slug {}: {repo:?} has {} attention heads ({} for keys and values), which the size's {} GPUs cannot share evenly (tensor parallelism); choose a size with a GPU count that divides them.",
                    size.gpu_slug, need.heads, need.kv_heads, size.gpu.count
                )));
            }
            let smallest = self.smallest_fitting(&need);
            let advice = match smallest {
                Some(s) => format!(
                    "the smallest size in {} that fits is {}",
                    self.region, s.gpu_slug
                ),
                None => format!("no size in {} fits it", self.region),
            };
            return Err(ApiError::Unprocessable(format!(
                "{at}.accelerators[{j}].accelerator_slug {}: {repo:?} needs {:.1} GiB of GPU memory ({:.1} GiB of weights, {:.1} GiB of KV cache for a {}-token context, {:.1} GiB of overhead) and the size offers {:.1} GiB ({:.0} % of {} GiB); {advice}.",
                size.gpu_slug,
                need.total_gib(size),
                need.weights_gib,
                need.kv_gib(),
                need.context,
                OVERHEAD_PER_GPU_GIB * size.gpu.count as f64,
                usable_gib(size),
                GPU_MEMORY_UTILIZATION * 100.0,
                size.node_vram_gb(),
            )));
        }
        Ok(())
    }

    /// The size in this region with the least GPU memory (then the cheapest) that fits.
    fn smallest_fitting(&self, need: &Need) -> Option<&Size> {
        let mut sizes: Vec<&Size> = self
            .catalog
            .sizes
            .iter()
            .filter(|s| s.regions.iter().any(|r| r == &self.region) && need.fits(s))
            .filter(|s| need.splits_over(s.gpu.count))
            .collect();
        sizes.sort_by(|a, b| {
            a.node_vram_gb().cmp(&b.node_vram_gb()).then_with(|| {
                let price = |s: &Size| s.price_per_hour.parse::<f64>().unwrap_or(f64::MAX);
                price(a).total_cmp(&price(b))
            })
        });
        sizes.first().copied()
    }
}

/// Gives each deployment of a spec about to be checked the commit it keeps: that of a
/// deployment of `latest` (the DI's latest spec; empty on a create) of the same repository at the
/// same revision, `None` (none yet, or one stored before commits were pinned) included; any
/// other deployment's commit is cleared, since only the Hub's answer sets one. Answers which
/// deployments kept one, for [`pin_reported`].
pub fn keep_commits(deployments: &mut [ModelDeployment], latest: &[ModelDeployment]) -> Vec<bool> {
    deployments
        .iter_mut()
        .map(|d| {
            let kept = latest.iter().find(|p| p.source.names_the_same(&d.source));
            d.source.commit = kept.and_then(|p| p.source.commit.clone());
            kept.is_some()
        })
        .collect()
}

/// After [`Models::check`]: each deployment that kept no commit takes the one the Hub reported
/// for it (a customer's repository; catalog models are not asked, and stay unpinned).
pub fn pin_reported(
    deployments: &mut [ModelDeployment],
    kept: &[bool],
    reported: Vec<Option<String>>,
) {
    for ((d, kept), commit) in deployments.iter_mut().zip(kept).zip(reported) {
        if !kept {
            d.source.commit = commit;
        }
    }
}

/// The Hub's `sha` when it is a commit id, lowercase as the Hub writes them. Anything else
/// (which the Hub does not send) pins nothing: the deployment loads its revision as named.
fn reported_commit(repo: &str, sha: &str) -> Option<String> {
    if is_commit(sha) {
        Some(sha.to_ascii_lowercase())
    } else {
        tracing::warn!(
            repo,
            sha,
            "the Hugging Face Hub reported no commit id for a revision"
        );
        None
    }
}

fn slugs(d: &ModelDeployment) -> Vec<&str> {
    d.accelerators
        .iter()
        .map(|a| a.accelerator_slug.as_str())
        .collect()
}

fn usable_gib(size: &Size) -> f64 {
    GPU_MEMORY_UTILIZATION * size.node_vram_gb() as f64
}

/// GPU memory a model needs, from its weights and its config.
#[derive(Debug, Clone, PartialEq)]
struct Need {
    weights_gib: f64,
    kv_bytes_per_token: u64,
    /// The sequence length sized for: the model's own (vLLM's default `--max-model-len`); one
    /// sequence of it must fit, or vLLM does not start.
    context: u64,
    /// The model's own context (`max_position_embeddings`), when its config says.
    model_context: Option<u64>,
    heads: u64,
    kv_heads: u64,
}

impl Need {
    fn of(parameters: &BTreeMap<String, u64>, config: &serde_json::Value) -> Result<Need, String> {
        if parameters.is_empty() {
            return Err("has no safetensors weights: the model server needs them to load (and the Hub to size) the model.".into());
        }
        // A Hub's numbers are input: saturating, so absurd ones read as "does not fit".
        let weights: u64 = parameters
            .iter()
            .map(|(dtype, count)| count.saturating_mul(served_bytes(dtype)))
            .fold(0, u64::saturating_add);
        // Multimodal configs keep the language model's numbers under `text_config`.
        let text = config
            .get("text_config")
            .filter(|t| t.is_object())
            .unwrap_or(config);
        let number = |k: &str| text.get(k).and_then(serde_json::Value::as_u64);
        // Each must be a positive whole number: a zero would size the KV cache at nothing.
        let positive = |k: &str| match number(k) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(format!("has no positive {k} in its config.json.")),
        };
        let layers = positive("num_hidden_layers")?;
        let heads = positive("num_attention_heads")?;
        let kv_heads = match number("num_key_value_heads") {
            None => heads,
            Some(_) => positive("num_key_value_heads")?,
        };
        let head_dim = match number("head_dim") {
            Some(_) => positive("head_dim")?,
            None => match positive("hidden_size")? / heads {
                0 => return Err("has a hidden_size smaller than its num_attention_heads.".into()),
                d => d,
            },
        };
        // Keys and values, every layer, in 16-bit.
        let kv_bytes_per_token = [layers, kv_heads, head_dim, 2]
            .into_iter()
            .fold(2u64, u64::saturating_mul);
        let model_context = number("max_position_embeddings").filter(|n| *n > 0);
        Ok(Need {
            weights_gib: weights as f64 / GIB,
            kv_bytes_per_token,
            context: model_context.unwrap_or(DEFAULT_CONTEXT),
            model_context,
            heads,
            kv_heads,
        })
    }

    /// Whether tensor parallelism over `gpus` GPUs can split the attention heads evenly (vLLM
    /// refuses otherwise): the query heads must divide, and the key-value heads divide or are
    /// replicated evenly.
    fn splits_over(&self, gpus: u32) -> bool {
        let gpus = u64::from(gpus.max(1));
        self.heads.is_multiple_of(gpus)
            && (self.kv_heads.is_multiple_of(gpus) || gpus.is_multiple_of(self.kv_heads))
    }

    fn kv_gib(&self) -> f64 {
        self.kv_bytes_per_token.saturating_mul(self.context) as f64 / GIB
    }

    fn total_gib(&self, size: &Size) -> f64 {
        self.weights_gib + self.kv_gib() + OVERHEAD_PER_GPU_GIB * size.gpu.count as f64
    }

    fn fits(&self, size: &Size) -> bool {
        self.total_gib(size) <= usable_gib(size) && self.splits_over(size.gpu.count)
    }
}

/// Bytes per parameter as vLLM holds a checkpoint's tensors: 32-bit floats are served in 16 bits
/// (its `auto` dtype), 8-bit types stay 8-bit, packed integer quantizations are counted as
/// stored.
fn served_bytes(dtype: &str) -> u64 {
    match dtype.to_ascii_uppercase().as_str() {
        "F64" | "I64" | "U64" => 8,
        "I32" | "U32" => 4,
        "F32" | "F16" | "BF16" | "I16" | "U16" => 2,
        _ => 1, // F8_E4M3, F8_E5M2, I8, U8, BOOL and packed 4-bit formats
    }
}

fn rejected_token() -> ApiError {
    ApiError::Unprocessable(
        "access_tokens.hugging_face_token is not accepted by Hugging Face (invalid, expired or revoked): send a token with read access.".into(),
    )
}

/// A Hub answer other than the ones the checks know: a failure that may pass is a 503 (retry),
/// any other is final and quoted, since retrying would get the same.
fn hub_refused(field: &str, repo: &str, e: HubError) -> ApiError {
    match e.class() {
        ErrorClass::Transient { .. } => unavailable(e),
        ErrorClass::Conflict
        | ErrorClass::NotFound
        | ErrorClass::Unauthorized
        | ErrorClass::Refused
        | ErrorClass::Permanent => ApiError::Unprocessable(format!(
            "{field} {repo:?}: Hugging Face answered what the model server could not use ({e})."
        )),
    }
}

fn unavailable(e: HubError) -> ApiError {
    tracing::warn!(error = %e, "the Hugging Face Hub did not answer");
    ApiError::Unavailable("Hugging Face did not answer; retry shortly.".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::catalog::EMBEDDED;
    use serde_json::json;

    /// A Hub answer the checks do not word themselves: a 503 when it may pass, else a 422 that
    /// quotes it.
    #[test]
    fn an_answer_the_checks_do_not_know_is_quoted_unless_it_passes() {
        let passing = HubError::Transient {
            message: "HTTP 503: busy".into(),
            retry_after: Some(Duration::from_secs(1)),
        };
        assert!(matches!(
            hub_refused("f", "org/m", passing),
            ApiError::Unavailable(_)
        ));
        let odd = HubError::Unexpected("HTTP 400: disabled".into());
        assert!(matches!(
            hub_refused("f", "org/m", odd),
            ApiError::Unprocessable(m) if m.contains("disabled") && m.starts_with("f \"org/m\"")
        ));
    }

    fn llama_8b() -> (BTreeMap<String, u64>, serde_json::Value) {
        (
            [("BF16".to_string(), 8_030_261_248)].into_iter().collect(),
            json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072}),
        )
    }

    #[test]
    fn weights_and_kv_cache_are_sized_from_the_hubs_numbers() {
        let (params, config) = llama_8b();
        let need = Need::of(&params, &config).unwrap();
        // 8.03 B parameters in BF16: 14.96 GiB.
        assert!((need.weights_gib - 14.96).abs() < 0.01, "{need:?}");
        // 2 × 32 layers × 8 KV heads × 128 dims × 2 bytes = 128 KiB per token; 16 GiB at 128k.
        assert_eq!(need.kv_bytes_per_token, 131_072);
        assert_eq!(need.context, 131_072);
        assert!((need.kv_gib() - 16.0).abs() < 1e-9);
        // 32-bit checkpoints are served in 16 bits; 8-bit ones stay 8-bit.
        let f32: BTreeMap<String, u64> = [("F32".to_string(), 1u64 << 30)].into_iter().collect();
        assert!((Need::of(&f32, &config).unwrap().weights_gib - 2.0).abs() < 1e-9);
        let f8: BTreeMap<String, u64> = [("F8_E4M3".to_string(), 1u64 << 30)].into_iter().collect();
        assert!((Need::of(&f8, &config).unwrap().weights_gib - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_smallest_size_that_fits_is_named() {
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        let models = Models::new("atl1", "http://127.0.0.1:9", catalog.clone()).unwrap();
        let size = |s: &str| catalog.size(s).unwrap();
        // A 70B model in BF16 (~131 GiB): not on one H100 or H200, on eight H100s or an MI300X.
        let params: BTreeMap<String, u64> =
            [("BF16".to_string(), 70_553_706_496)].into_iter().collect();
        let config = json!({"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                            "num_key_value_heads": 8, "max_position_embeddings": 131072});
        let need = Need::of(&params, &config).unwrap();
        assert!(!need.fits(size("gpu-h100x1-80gb")));
        assert!(!need.fits(size("gpu-h200x1-141gb")));
        assert!(need.fits(size("gpu-mi300x1-192gb")));
        assert_eq!(
            models.smallest_fitting(&need).unwrap().gpu_slug,
            "gpu-mi300x1-192gb"
        );
        // An 8B model fits an L40S, its full 128k context included: the smallest size.
        let (params, config) = llama_8b();
        let need = Need::of(&params, &config).unwrap();
        assert!(need.fits(size("gpu-l40sx1-48gb")));
        assert_eq!(
            models.smallest_fitting(&need).unwrap().gpu_slug,
            "gpu-l40sx1-48gb"
        );
        // A 14B model (Qwen2.5 14B's numbers): its 128k context's KV cache does not fit an L40S.
        let params: BTreeMap<String, u64> =
            [("BF16".to_string(), 14_770_033_664)].into_iter().collect();
        let config = json!({"hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                            "num_key_value_heads": 8, "max_position_embeddings": 131072});
        let need = Need::of(&params, &config).unwrap();
        assert!(!need.fits(size("gpu-l40sx1-48gb")));
        assert_eq!(
            models.smallest_fitting(&need).unwrap().gpu_slug,
            "gpu-h100x1-80gb"
        );
    }

    #[test]
    fn tensor_parallelism_must_split_the_heads() {
        // Qwen2.5 7B: 28 query heads, 4 key-value heads.
        let params: BTreeMap<String, u64> =
            [("BF16".to_string(), 7_615_616_512)].into_iter().collect();
        let config = json!({"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                            "num_key_value_heads": 4, "max_position_embeddings": 32768});
        let need = Need::of(&params, &config).unwrap();
        assert!(need.splits_over(1) && need.splits_over(4));
        assert!(!need.splits_over(8), "28 heads do not split over 8 GPUs");
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        assert!(!need.fits(catalog.size("gpu-h100x8-640gb").unwrap()));
        // Fewer key-value heads than GPUs are replicated, when the GPUs divide by them.
        let gqa = json!({"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                         "num_key_value_heads": 2, "max_position_embeddings": 8192});
        assert!(Need::of(&params, &gqa).unwrap().splits_over(8));
    }

    fn custom(repo: &str, revision: Option<&str>, commit: Option<&str>) -> ModelDeployment {
        ModelDeployment {
            model_id: None,
            model_slug: repo.into(),
            model_provider: "hugging_face".into(),
            provider_model_id: repo.into(),
            source: api_types::spec::ModelSource {
                repository: repo.into(),
                revision: revision.map(str::to_string),
                custom: true,
                commit: commit.map(str::to_string),
            },
            workload_config: json!({}),
            accelerators: vec![],
        }
    }

    /// A PATCH keeps the commit of a deployment that names the same repository and revision
    /// (none, for one stored before pinning); anything else takes the Hub's answer, and a commit
    /// sent in is never trusted.
    #[test]
    fn commits_are_kept_for_the_same_revision_and_taken_from_the_hub_otherwise() {
        let (old, new) = ("a".repeat(40), "b".repeat(40));
        let latest = [
            custom("org/m", Some("main"), Some(&old)),
            custom("org/legacy", None, None),
        ];
        let mut next = [
            // The same, its case aside: kept, whatever the Hub says now.
            custom("Org/M", Some("main"), None),
            // Stored before pinning: stays unpinned.
            custom("org/legacy", None, None),
            // Another revision of it: the Hub's answer.
            custom("org/m", Some(&new), Some(&old)),
            // The same repository from the catalog: not the same source.
            ModelDeployment {
                source: api_types::spec::ModelSource {
                    custom: false,
                    ..custom("org/m", Some("main"), None).source
                },
                ..custom("org/m", Some("main"), None)
            },
        ];
        let kept = keep_commits(&mut next, &latest);
        assert_eq!(kept, [true, true, false, false]);
        // What the check asks the Hub at: the kept commit, else the revision named.
        assert_eq!(next[0].source.loaded_revision(), Some(old.as_str()));
        assert_eq!(next[2].source.loaded_revision(), Some(new.as_str()));
        let reported = vec![
            Some(new.clone()),
            Some(new.clone()),
            Some(new.clone()),
            None,
        ];
        pin_reported(&mut next, &kept, reported);
        let commits: Vec<Option<&str>> = next.iter().map(|d| d.source.commit.as_deref()).collect();
        assert_eq!(
            commits,
            [Some(old.as_str()), None, Some(new.as_str()), None]
        );
        // A create keeps nothing.
        let mut created = [custom("org/m", Some("main"), Some(&old))];
        assert_eq!(keep_commits(&mut created, &[]), [false]);
        assert_eq!(created[0].source.commit, None);
    }

    #[test]
    fn only_a_commit_id_is_pinned() {
        let sha = "0123456789ABCDEF0123456789abcdef01234567";
        assert_eq!(
            reported_commit("org/m", sha).as_deref(),
            Some("0123456789abcdef0123456789abcdef01234567")
        );
        assert_eq!(reported_commit("org/m", "main"), None);
        assert_eq!(reported_commit("org/m", &"g".repeat(40)), None);
        assert_eq!(reported_commit("org/m", ""), None);
    }

    #[test]
    fn a_config_without_its_numbers_is_refused_by_name() {
        let (params, _) = llama_8b();
        let why = Need::of(&params, &json!({"hidden_size": 1})).unwrap_err();
        assert!(why.contains("num_hidden_layers"), "{why}");
        // Zeros would size the KV cache at nothing.
        let zero = json!({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 0});
        assert!(Need::of(&params, &zero)
            .unwrap_err()
            .contains("num_key_value_heads"));
        let why = Need::of(&BTreeMap::new(), &json!({})).unwrap_err();
        assert!(why.contains("safetensors"), "{why}");
        // Absurd numbers do not overflow: they do not fit.
        let huge: BTreeMap<String, u64> = [
            ("F64".to_string(), u64::MAX),
            ("BF16".to_string(), u64::MAX),
        ]
        .into_iter()
        .collect();
        let config = json!({"num_hidden_layers": u64::MAX, "num_attention_heads": 1,
                            "head_dim": u64::MAX, "max_position_embeddings": u64::MAX});
        let need = Need::of(&huge, &config).unwrap();
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        assert!(catalog.sizes.iter().all(|s| !need.fits(s)));
    }
}

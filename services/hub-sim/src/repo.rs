//! Model repositories as the simulated Hub holds them, a helper that makes a plausible one from a
//! few numbers, and the catalog's models with the numbers of their real model cards.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// How a repository is gated. On the wire (model info's `gated`, the `/_sim` bodies): `false`,
/// `"auto"` or `"manual"`, as the Hub writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gated {
    #[default]
    No,
    /// Access requests are granted at once (still a request per user, hence a token per user).
    Auto,
    /// The authors review each access request.
    Manual,
}

impl Gated {
    pub fn is_gated(self) -> bool {
        self != Gated::No
    }
}

impl Serialize for Gated {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Gated::No => s.serialize_bool(false),
            Gated::Auto => s.serialize_str("auto"),
            Gated::Manual => s.serialize_str("manual"),
        }
    }
}

impl<'de> Deserialize<'de> for Gated {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Wire {
            Bool(bool),
            Str(String),
        }
        match Wire::deserialize(d)? {
            Wire::Bool(false) => Ok(Gated::No),
            // What the Hub wrote before gating had modes.
            Wire::Bool(true) => Ok(Gated::Manual),
            Wire::Str(s) => match s.as_str() {
                "auto" => Ok(Gated::Auto),
                "manual" => Ok(Gated::Manual),
                "false" => Ok(Gated::No),
                other => Err(serde::de::Error::custom(format!(
                    "gated must be false, \"auto\" or \"manual\", not {other:?}"
                ))),
            },
        }
    }
}

/// A model repository. Lookups by id ignore case, as the Hub's do.
///
/// Its content (config, safetensors counts, files) is that of every revision, except that a
/// revision pushed with its own `config.json` serves that one (`revision_configs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Repo {
    /// `org/name`.
    pub id: String,
    pub private: bool,
    pub gated: Gated,
    /// Tokens of the repository's owners: they read it whether private or gated.
    pub owners: BTreeSet<String>,
    /// Tokens granted access to the gated (or private) repository.
    pub granted: BTreeSet<String>,
    /// Branch name → 40-hex commit sha. Always has `main` once published.
    pub revisions: BTreeMap<String, String>,
    /// `config.json` of `main` (and of every revision without its own). `null`: the repository
    /// has no `config.json`.
    pub config: Value,
    /// Commit sha → `config.json` for commits whose config differs from `config` (revisions
    /// pushed with their own, and the commits `main` was at before such a push).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub revision_configs: BTreeMap<String, Value>,
    /// Safetensors parameter counts by dtype, e.g. `{"BF16": 7615616512}`; empty: no safetensors.
    pub safetensors: BTreeMap<String, u64>,
    /// Files (`rfilename`s), `config.json` among them when `config` is not null.
    pub files: Vec<String>,
    /// RFC 3339; set when published or when `main` moves.
    pub last_modified: String,
}

impl Default for Repo {
    fn default() -> Self {
        Repo {
            id: String::new(),
            private: false,
            gated: Gated::No,
            owners: BTreeSet::new(),
            granted: BTreeSet::new(),
            revisions: BTreeMap::new(),
            config: Value::Null,
            revision_configs: BTreeMap::new(),
            safetensors: BTreeMap::new(),
            files: Vec::new(),
            last_modified: String::new(),
        }
    }
}

/// The numbers [`Repo::from_spec`] makes a plausible repository from; also the body of
/// `POST /_sim/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub id: String,
    /// E.g. `LlamaForCausalLM`; `model_type` is derived from it.
    pub architecture: String,
    /// Parameter count (all BF16).
    pub params: u64,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub max_position_embeddings: u64,
    #[serde(default)]
    pub private: bool,
    #[serde(default)]
    pub gated: Gated,
    /// Owner tokens.
    #[serde(default)]
    pub owners: Vec<String>,
}

/// A deterministic 40-hex "commit sha" for `seed`.
pub fn fake_sha(seed: &str) -> String {
    hex::encode(Sha256::digest(seed.as_bytes()))[..40].to_string()
}

/// Whether `s` is a 40-hex commit sha.
pub fn is_sha(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `model_type` for an architecture: the known ones as transformers names them, otherwise the
/// class name without `ForCausalLM`, in snake case.
pub fn model_type_for(architecture: &str) -> String {
    match architecture {
        "LlamaForCausalLM" => "llama".into(),
        "MistralForCausalLM" => "mistral".into(),
        "MixtralForCausalLM" => "mixtral".into(),
        "Qwen2ForCausalLM" => "qwen2".into(),
        "Qwen3ForCausalLM" => "qwen3".into(),
        "GptOssForCausalLM" => "gpt_oss".into(),
        "Gemma2ForCausalLM" => "gemma2".into(),
        other => {
            let stem = other.strip_suffix("ForCausalLM").unwrap_or(other);
            let mut out = String::new();
            for (i, c) in stem.chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            }
            out
        }
    }
}

/// Files of a repository whose weights are `bytes` long in safetensors shards of at most 5 GB
/// (the `save_pretrained` default), with the tokenizer and card files most text models carry.
fn standard_files(bytes: u64) -> Vec<String> {
    let mut files: Vec<String> = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .map(String::from)
    .to_vec();
    let shards = bytes.div_ceil(5_000_000_000).max(1);
    if shards == 1 {
        files.push("model.safetensors".into());
    } else {
        for i in 1..=shards {
            files.push(format!("model-{i:05}-of-{shards:05}.safetensors"));
        }
        files.push("model.safetensors.index.json".into());
    }
    files
}

impl Repo {
    /// A plausible text-generation repository: a `config.json` with these numbers (the
    /// intermediate size worked out from the parameter count, a 32k vocabulary, BF16), `params`
    /// BF16 safetensors parameters in 5 GB shards, tokenizer files, public and not gated.
    #[allow(clippy::too_many_arguments)]
    pub fn model(
        id: &str,
        architecture: &str,
        params: u64,
        layers: u64,
        hidden: u64,
        heads: u64,
        kv_heads: u64,
        max_position_embeddings: u64,
    ) -> Repo {
        Repo::from_spec(&ModelSpec {
            id: id.to_string(),
            architecture: architecture.to_string(),
            params,
            layers,
            hidden,
            heads,
            kv_heads,
            max_position_embeddings,
            private: false,
            gated: Gated::No,
            owners: Vec::new(),
        })
    }

    /// As [`Repo::model`], with the spec's visibility, gating and owners.
    pub fn from_spec(s: &ModelSpec) -> Repo {
        let vocab: u64 = 32_000;
        let heads = s.heads.max(1);
        let head_dim = s.hidden / heads;
        // params ≈ 2·vocab·hidden + layers·(attention + 3·hidden·intermediate)
        let attention = 2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * head_dim;
        let rest = s
            .params
            .saturating_sub(2 * vocab * s.hidden)
            .saturating_sub(s.layers * attention);
        let per_layer = 3 * s.hidden * s.layers.max(1);
        let intermediate = match rest.checked_div(per_layer) {
            Some(i) if i >= 256 => i / 256 * 256,
            _ => 4 * s.hidden,
        };
        let config = json!({
            "architectures": [s.architecture],
            "model_type": model_type_for(&s.architecture),
            "hidden_size": s.hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads,
            "max_position_embeddings": s.max_position_embeddings,
            "vocab_size": vocab,
            "torch_dtype": "bfloat16",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
            "use_cache": true,
            "transformers_version": "4.46.0",
        });
        Repo {
            id: s.id.clone(),
            private: s.private,
            gated: s.gated,
            owners: s.owners.iter().cloned().collect(),
            config,
            safetensors: BTreeMap::from([("BF16".to_string(), s.params)]),
            files: standard_files(s.params * 2),
            ..Repo::default()
        }
    }

    pub fn gated(mut self, gated: Gated) -> Repo {
        self.gated = gated;
        self
    }

    pub fn private(mut self) -> Repo {
        self.private = true;
        self
    }

    /// Adds an owner token.
    pub fn owned_by(mut self, token: &str) -> Repo {
        self.owners.insert(token.to_string());
        self
    }

    /// Sets one key of `config.json`.
    pub fn with_config(mut self, key: &str, value: Value) -> Repo {
        if !self.config.is_object() {
            self.config = json!({});
        }
        self.config[key] = value;
        self
    }

    /// `org`, the part of the id before the slash.
    pub fn author(&self) -> &str {
        self.id.split_once('/').map_or("", |(org, _)| org)
    }

    /// The commit `main` is at.
    pub fn sha(&self) -> &str {
        self.revisions.get("main").map_or("", String::as_str)
    }

    /// Whether `token` reads the repository even when private or gated.
    pub fn can_read(&self, token: Option<&str>) -> bool {
        token.is_some_and(|t| self.owners.contains(t) || self.granted.contains(t))
    }

    /// The commit a revision names (a branch, or the sha of a commit the repository has), and
    /// that commit's `config.json`.
    pub fn resolve(&self, revision: &str) -> Option<(String, &Value)> {
        let sha = match self.revisions.get(revision) {
            Some(sha) => sha.clone(),
            None => {
                let rev = revision.to_ascii_lowercase();
                let known = self.revisions.values().any(|s| *s == rev)
                    || self.revision_configs.contains_key(&rev);
                if !is_sha(&rev) || !known {
                    return None;
                }
                rev
            }
        };
        let config = self.revision_configs.get(&sha).unwrap_or(&self.config);
        Some((sha, config))
    }

    /// Checks the id and shas and fills what a published repository always has: a `main`
    /// revision, `last_modified`, and `config.json` listed exactly when there is a config.
    pub(crate) fn normalize(&mut self) -> Result<(), String> {
        check_id(&self.id)?;
        if !self.revisions.contains_key("main") {
            self.revisions
                .insert("main".into(), fake_sha(&format!("{}@main", self.id)));
        }
        for (name, sha) in self.revisions.iter_mut() {
            if name.is_empty() || !is_sha(sha) {
                return Err(format!("revision {name:?}: {sha:?} is not a 40-hex sha"));
            }
            *sha = sha.to_ascii_lowercase();
        }
        if self.last_modified.is_empty() {
            self.last_modified = now();
        }
        let has_config = !self.config.is_null();
        self.files.retain(|f| f != "config.json");
        if has_config {
            self.files.push("config.json".into());
        }
        self.files.sort();
        self.files.dedup();
        Ok(())
    }
}

/// `org/name` with the characters the Hub allows.
pub(crate) fn check_id(id: &str) -> Result<(), String> {
    let ok_part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !p.contains("--")
            && !p.contains("..")
    };
    match id.split_once('/') {
        Some((org, name)) if ok_part(org) && ok_part(name) => Ok(()),
        _ => Err(format!("repository id {id:?} is not org/name")),
    }
}

pub(crate) fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The catalog's models (`catalog/catalog.json`) and gpt-oss-120b, with the `config.json`
/// numbers and safetensors counts of their model cards. Llama 3.1 8B and 3.3 70B are gated
/// (manual review), Mistral 7B v0.3 is gated (auto-approved), the others are open.
pub fn seed_repos() -> Vec<Repo> {
    let at = |r: Repo, modified: &str| Repo {
        last_modified: modified.to_string(),
        ..r
    };
    let llama_rope = json!({
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3"
    });
    let llama = |id: &str, params: u64, layers: u64, hidden: u64, heads: u64, inter: u64| {
        Repo::model(
            id,
            "LlamaForCausalLM",
            params,
            layers,
            hidden,
            heads,
            8,
            131_072,
        )
        .with_config("intermediate_size", json!(inter))
        .with_config("vocab_size", json!(128_256))
        .with_config("rope_theta", json!(500_000.0))
        .with_config("rope_scaling", llama_rope.clone())
        .with_config("bos_token_id", json!(128_000))
        .with_config("eos_token_id", json!([128_001, 128_008, 128_009]))
        .with_config("attention_bias", json!(false))
        .with_config("mlp_bias", json!(false))
    };
    let gpt_oss = |id: &str, layers: u64, experts: u64, bf16: u64, u8_: u64| {
        let mut r = Repo::model(id, "GptOssForCausalLM", bf16 + u8_, layers, 2880, 64, 8, 131_072)
            .with_config("head_dim", json!(64))
            .with_config("intermediate_size", json!(2880))
            .with_config("vocab_size", json!(201_088))
            .with_config("num_local_experts", json!(experts))
            .with_config("num_experts_per_tok", json!(4))
            .with_config("experts_per_token", json!(4))
            .with_config("sliding_window", json!(128))
            .with_config("rope_theta", json!(150_000.0))
            .with_config(
                "rope_scaling",
                json!({"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_type": "yarn",
                       "original_max_position_embeddings": 4096, "truncate": false}),
            )
            .with_config("attention_bias", json!(true))
            .with_config("tie_word_embeddings", json!(false))
            .with_config(
                "quantization_config",
                json!({"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"]}),
            );
        r.safetensors = BTreeMap::from([("BF16".into(), bf16), ("U8".into(), u8_)]);
        r
    };
    vec![
        at(
            Repo::model(
                "Qwen/Qwen2.5-7B-Instruct",
                "Qwen2ForCausalLM",
                7_615_616_512,
                28,
                3584,
                28,
                4,
                32_768,
            )
            .with_config("intermediate_size", json!(18_944))
            .with_config("vocab_size", json!(152_064))
            .with_config("rope_theta", json!(1_000_000.0))
            .with_config("rms_norm_eps", json!(1e-6))
            .with_config("sliding_window", json!(131_072))
            .with_config("use_sliding_window", json!(false))
            .with_config("max_window_layers", json!(28))
            .with_config("bos_token_id", json!(151_643))
            .with_config("eos_token_id", json!(151_645)),
            "2025-01-12T02:10:10.000Z",
        ),
        at(
            llama(
                "meta-llama/Llama-3.1-8B-Instruct",
                8_030_261_248,
                32,
                4096,
                32,
                14_336,
            )
            .gated(Gated::Manual),
            "2024-09-25T17:00:57.000Z",
        ),
        at(
            llama(
                "meta-llama/Llama-3.3-70B-Instruct",
                70_553_706_496,
                80,
                8192,
                64,
                28_672,
            )
            .gated(Gated::Manual),
            "2024-12-21T18:28:01.000Z",
        ),
        at(
            Repo::model(
                "mistralai/Mistral-7B-Instruct-v0.3",
                "MistralForCausalLM",
                7_248_023_552,
                32,
                4096,
                32,
                8,
                32_768,
            )
            .with_config("intermediate_size", json!(14_336))
            .with_config("vocab_size", json!(32_768))
            .with_config("rope_theta", json!(1_000_000.0))
            .with_config("sliding_window", Value::Null)
            .with_config("bos_token_id", json!(1))
            .with_config("eos_token_id", json!(2))
            .gated(Gated::Auto),
            "2024-08-21T12:18:25.000Z",
        ),
        at(
            llama(
                "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
                70_553_706_496,
                80,
                8192,
                64,
                28_672,
            )
            .with_config("bos_token_id", json!(128_000))
            .with_config("eos_token_id", json!(128_001)),
            "2025-02-24T03:31:15.000Z",
        ),
        // MXFP4 expert weights: the Hub counts each U8 block byte as two parameters.
        at(
            gpt_oss("openai/gpt-oss-20b", 24, 32, 1_804_459_584, 19_707_494_400),
            "2025-08-26T17:25:47.000Z",
        ),
        at(
            gpt_oss(
                "openai/gpt-oss-120b",
                36,
                128,
                2_167_371_072,
                118_244_966_400,
            ),
            "2025-08-26T17:25:03.000Z",
        ),
    ]
}

/// The token [`seed_repos`]' gated repositories are granted to, for tests and scripts.
pub const SEED_READER_TOKEN: &str = "hf_sim_reader";
/// Its user.
pub const SEED_READER_USER: &str = "sim-reader";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gated_wire_form() {
        for (g, wire) in [
            (Gated::No, "false"),
            (Gated::Auto, "\"auto\""),
            (Gated::Manual, "\"manual\""),
        ] {
            assert_eq!(serde_json::to_string(&g).unwrap(), wire);
            assert_eq!(serde_json::from_str::<Gated>(wire).unwrap(), g);
        }
        assert!(serde_json::from_str::<Gated>("\"sometimes\"").is_err());
    }

    #[test]
    fn plausible_model_numbers() {
        let mut r = Repo::model(
            "acme/m-7b",
            "LlamaForCausalLM",
            7_000_000_000,
            32,
            4096,
            32,
            8,
            8192,
        );
        r.normalize().unwrap();
        assert_eq!(r.config["model_type"], "llama");
        assert!(
            r.config.get("head_dim").is_none(),
            "hidden / heads unless a config says"
        );
        let inter = r.config["intermediate_size"].as_u64().unwrap();
        assert!((10_000..20_000).contains(&inter), "{inter}");
        assert!(r
            .files
            .contains(&"model-00003-of-00003.safetensors".to_string()));
        assert!(r.files.contains(&"config.json".to_string()));
        assert!(is_sha(r.sha()));
        assert_eq!(model_type_for("FalconMambaForCausalLM"), "falcon_mamba");
    }

    #[test]
    fn seeds_are_valid() {
        for mut r in seed_repos() {
            r.normalize().unwrap();
            let c = &r.config;
            for key in [
                "architectures",
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "torch_dtype",
                "vocab_size",
            ] {
                assert!(!c[key].is_null(), "{}: {key}", r.id);
            }
        }
    }

    #[test]
    fn ids_are_checked() {
        assert!(check_id("Qwen/Qwen2.5-7B-Instruct").is_ok());
        for bad in ["gpt2", "a/b/c", "/x", "a/", "a/b c", "a/b--c", "a/..b"] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }
}

//! Turning a public spec (either client dialect) into the normalised `Spec`, checked against the
//! catalog. Every refusal names the field, in the public request's terms.

use api_types::public::{ModelDeploymentInput, SpecInput};
use api_types::spec::{AcceleratorGroup, ModelDeployment, ModelSource, Spec};
use uuid::Uuid;

use crate::error::ApiError;
use api_types::catalog::{Catalog, Model as CatalogModel};

pub const ROLES: &[&str] = &["prefill_decode", "prefill", "decode"];
pub const MAX_SCALE: i64 = 64;
pub const MAX_DEPLOYMENTS: usize = 16;
/// Bounds of a deployment's `workload_config`. The hints it carries are small and shallow; the
/// bounds keep the documents that carry it (the sealed create intent, the region's records, the
/// change feed) small and well inside serde_json's recursion limit.
pub const MAX_WORKLOAD_CONFIG_BYTES: usize = 16 * 1024;
pub const MAX_WORKLOAD_CONFIG_DEPTH: usize = 16;
// The documents that carry a workload_config wrap it at most six levels deep (the change feed:
// records[].spec.model_deployments[].workload_config): each always reads back.
const _: () = assert!(MAX_WORKLOAD_CONFIG_DEPTH + 6 < 128);

fn invalid(message: String) -> ApiError {
    ApiError::Unprocessable(message)
}

pub fn name(field: &str, name: &str) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > 255 {
        return Err(invalid(format!(
            "{field} must be 1 to 255 characters long."
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(invalid(format!(
            "{field} may contain only letters, digits, '-' and '_'."
        )));
    }
    Ok(())
}

pub fn region(catalog: &Catalog, field: &str, region: &str) -> Result<(), ApiError> {
    if catalog.has_region(region) {
        Ok(())
    } else {
        Err(invalid(format!(
            "{field} {region:?} is not a region where Dedicated Inference is available ({}).",
            catalog.regions.join(", ")
        )))
    }
}

/// What validation found besides the spec itself.
pub struct Checked {
    pub spec: Spec,
    /// Some deployment runs a gated model, so a Hugging Face token is required.
    pub gated: bool,
}

pub fn spec(catalog: &Catalog, input: &SpecInput) -> Result<Checked, ApiError> {
    name("spec.name", &input.name)?;
    region(catalog, "spec.region", &input.region)?;
    // No VPC (absent or null, as godo and Terraform send when none is set): the team's default
    // VPC in the region, which the region resolves.
    let vpc_text = match (&input.vpc, &input.vpc_config) {
        (Some(vpc), _) => Some(vpc.uuid.as_str()),
        (None, Some(config)) => Some(config.vpc_uuid.as_str()),
        (None, None) => None,
    };
    let vpc_uuid = vpc_text
        .map(|text| {
            Uuid::parse_str(text).map_err(|_| invalid("spec.vpc.uuid must be a UUID.".into()))
        })
        .transpose()?;
    if input.version < 0 || input.version > i32::MAX as i64 {
        return Err(invalid("spec.version is out of range.".into()));
    }
    if input.model_deployments.is_empty() {
        return Err(invalid(
            "spec.model_deployments needs at least one model deployment.".into(),
        ));
    }
    if input.model_deployments.len() > MAX_DEPLOYMENTS {
        return Err(invalid(format!(
            "spec.model_deployments allows at most {MAX_DEPLOYMENTS} entries."
        )));
    }
    let mut gated = false;
    let mut deployments = Vec::with_capacity(input.model_deployments.len());
    for (i, d) in input.model_deployments.iter().enumerate() {
        let (deployment, is_gated) = deployment(
            catalog,
            &input.region,
            &format!("spec.model_deployments[{i}]"),
            d,
        )?;
        gated |= is_gated;
        // Requests name the model they want: two deployments answering to one name could not
        // be told apart.
        if let Some(j) = deployments
            .iter()
            .position(|d: &ModelDeployment| d.model_slug == deployment.model_slug)
        {
            return Err(invalid(format!(
                "spec.model_deployments[{i}] serves {:?}, as spec.model_deployments[{j}] does: give it another model_slug.",
                deployment.model_slug
            )));
        }
        deployments.push(deployment);
    }
    Ok(Checked {
        spec: Spec {
            version: input.version as i32,
            name: input.name.clone(),
            region: input.region.clone(),
            vpc_uuid,
            enable_public_endpoint: input.enable_public_endpoint,
            model_deployments: deployments,
        },
        gated,
    })
}

fn deployment(
    catalog: &Catalog,
    region: &str,
    at: &str,
    d: &ModelDeploymentInput,
) -> Result<(ModelDeployment, bool), ApiError> {
    let (model_slug, source, catalog_model) = model(catalog, at, d)?;
    let model_id = match d.model_id.as_deref() {
        None | Some("") => None,
        Some(text) => Some(
            Uuid::parse_str(text)
                .map_err(|_| invalid(format!("{at}.model_id must be a UUID or empty.")))?,
        ),
    };
    let workload_config = match &d.workload_config {
        None | Some(serde_json::Value::Null) => serde_json::json!({}),
        Some(v @ serde_json::Value::Object(_)) => {
            let v = bounded_workload_config(at, v)?;
            declared_workload(&format!("{at}.workload_config"), &v)?;
            v
        }
        Some(_) => return Err(invalid(format!("{at}.workload_config must be an object."))),
    };
    if d.accelerators.is_empty() {
        return Err(invalid(format!(
            "{at}.accelerators needs at least one accelerator."
        )));
    }
    let mut accelerators = Vec::with_capacity(d.accelerators.len());
    for (j, a) in d.accelerators.iter().enumerate() {
        let at = format!("{at}.accelerators[{j}]");
        if !(1..=MAX_SCALE).contains(&a.scale) {
            return Err(invalid(format!(
                "{at}.scale must be between 1 and {MAX_SCALE}."
            )));
        }
        if !ROLES.contains(&a.role.as_str()) {
            return Err(invalid(format!(
                "{at}.type must be one of {}.",
                ROLES.join(", ")
            )));
        }
        let size = catalog.size(&a.accelerator_slug).ok_or_else(|| {
            invalid(format!(
                "{at}.accelerator_slug {:?} is not a Dedicated Inference size.",
                a.accelerator_slug
            ))
        })?;
        if !size.regions.iter().any(|r| r == region) {
            return Err(invalid(format!(
                "{at}.accelerator_slug {:?} is not available in {region}.",
                a.accelerator_slug
            )));
        }
        // A customer's own repository is sized against the GPUs by the region, which asks the
        // Hub for its weights.
        if let Some(model) = catalog_model {
            if !model.gpu_slugs.contains(&a.accelerator_slug) {
                return Err(invalid(format!(
                    "{at}.accelerator_slug {:?} cannot serve {} (supported: {}).",
                    a.accelerator_slug,
                    model.model_slug,
                    model.gpu_slugs.join(", ")
                )));
            }
        }
        if let Some((min, max)) = replica_bounds(&workload_config) {
            if !(min.max(1)..=max).contains(&a.scale) {
                return Err(invalid(format!(
                    "{at}.scale is the starting replica count and must lie within workload_config.autoscaling's bounds ({}..={max}).",
                    min.max(1)
                )));
            }
        }
        accelerators.push(AcceleratorGroup {
            accelerator_slug: a.accelerator_slug.clone(),
            role: a.role.clone(),
            scale: a.scale as i32,
        });
    }
    Ok((
        ModelDeployment {
            model_id,
            model_slug,
            model_provider: d
                .model_provider
                .clone()
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| HUGGING_FACE.to_string()),
            provider_model_id: d.provider_model_id.clone().unwrap_or_default(),
            source,
            workload_config,
            accelerators,
        },
        catalog_model.is_some_and(|m| m.is_gated_model),
    ))
}

pub const MODEL_CATALOG: &str = "modelcatalog";
pub const HUGGING_FACE: &str = "hugging_face";

/// What a deployment serves, under which name: a catalog model (`modelcatalog` with its
/// `model_slug`; `hugging_face` with a catalog slug and no `provider_model_id`, as callers of
/// the first version of this API send), or any Hugging Face repository (`hugging_face` with
/// `provider_model_id`, optionally `@revision`), called by `model_slug` when one is sent, else by
/// the repository's id.
fn model<'c>(
    catalog: &'c Catalog,
    at: &str,
    d: &ModelDeploymentInput,
) -> Result<(String, ModelSource, Option<&'c CatalogModel>), ApiError> {
    let provider = d
        .model_provider
        .as_deref()
        .filter(|p| !p.is_empty())
        .unwrap_or(HUGGING_FACE);
    let provider_model_id = d.provider_model_id.as_deref().unwrap_or_default();
    let slug = d.model_slug.as_deref().filter(|s| !s.is_empty());
    match provider {
        HUGGING_FACE if !provider_model_id.is_empty() => {
            let source = repository(&format!("{at}.provider_model_id"), provider_model_id)?;
            let name = match slug {
                Some(name) => served_name(&format!("{at}.model_slug"), name)?,
                None => source.repository.clone(),
            };
            Ok((name, source, None))
        }
        HUGGING_FACE | MODEL_CATALOG => {
            let slug = slug.ok_or_else(|| {
                invalid(if provider == HUGGING_FACE {
                    format!("{at}.provider_model_id (a Hugging Face repository) or {at}.model_slug (a catalog model) is required.")
                } else {
                    format!("{at}.model_slug is required.")
                })
            })?;
            let model = catalog.model(slug).ok_or_else(|| {
                invalid(format!(
                    "{at}.model_slug {slug:?} is not a catalog model (see /v2/dedicated-inferences/gpu-model-config); to serve a Hugging Face repository, send model_provider \"hugging_face\" and its id as provider_model_id."
                ))
            })?;
            if !provider_model_id.is_empty()
                && !provider_model_id.eq_ignore_ascii_case(&model.hugging_face_repo)
                && !provider_model_id.eq_ignore_ascii_case(&model.model_slug)
            {
                return Err(invalid(format!(
                    "{at}.provider_model_id {provider_model_id:?} is not the catalog model {} ({}); leave it empty, or use model_provider \"hugging_face\" to serve another repository.",
                    model.model_slug, model.hugging_face_repo
                )));
            }
            let source = ModelSource {
                repository: model.hugging_face_repo.clone(),
                revision: None,
                custom: false,
                commit: None,
            };
            Ok((model.model_slug.clone(), source, Some(model)))
        }
        other => Err(invalid(format!(
            "{at}.model_provider {other:?} is not a provider: use \"{MODEL_CATALOG}\" or \"{HUGGING_FACE}\"."
        ))),
    }
}

/// A Hugging Face repository id (`owner/name`, as the Hub allows them), optionally `@revision`
/// (a branch, tag or commit).
fn repository(field: &str, text: &str) -> Result<ModelSource, ApiError> {
    let (repository, revision) = match text.split_once('@') {
        Some((r, rev)) => (r, Some(rev)),
        None => (text, None),
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with('.')
            && !p.contains("..")
            && !p.contains("--")
    };
    let valid = matches!(repository.split_once('/'), Some((owner, name)) if part_ok(owner) && part_ok(name));
    if !valid {
        return Err(invalid(format!(
            "{field} {text:?} is not a Hugging Face repository id: expected owner/name, optionally @revision."
        )));
    }
    if let Some(rev) = revision {
        let rev_ok = !rev.is_empty()
            && rev.len() <= 255
            && rev
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
            && !rev.contains("..")
            && !rev.starts_with(['/', '.', '-']);
        if !rev_ok {
            return Err(invalid(format!(
                "{field} {text:?} has an invalid revision: a branch, tag or commit after '@'."
            )));
        }
    }
    // The commit is the region's to pin, from the Hub's answer.
    Ok(ModelSource {
        repository: repository.to_string(),
        revision: revision.map(str::to_string),
        custom: true,
        commit: None,
    })
}

/// The name clients call a customer's own model by (`model` in their requests).
fn served_name(field: &str, name: &str) -> Result<String, ApiError> {
    // It becomes a model server argument: a leading '-' would read as an option.
    let ok = name.len() <= 128
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/' | b':'));
    if ok {
        Ok(name.to_string())
    } else {
        Err(invalid(format!(
            "{field} {name:?} must start with a letter or digit and be at most 128 letters, digits and any of - _ . / :"
        )))
    }
}

/// The replica bounds `workload_config.autoscaling` declares (already checked): `min_replicas`
/// (default 1) and `max_replicas` (default: the starting scale itself, so any scale lies
/// within; the autoscaler then never grows past it); `None` without
/// autoscaling, when `scale` is fixed.
fn replica_bounds(config: &serde_json::Value) -> Option<(i64, i64)> {
    let a = config.get("autoscaling")?;
    let number = |k: &str| a.get(k).and_then(serde_json::Value::as_i64);
    let min = number("min_replicas").unwrap_or(1);
    let max = number("max_replicas").unwrap_or(MAX_SCALE).max(min);
    Some((min, max))
}

/// The known parts of a deployment's workload hints (`input_tokens`, `output_tokens`, `slo`,
/// `autoscaling`), each optional; other keys are kept as sent.
fn declared_workload(at: &str, config: &serde_json::Value) -> Result<(), ApiError> {
    use serde_json::Value;
    let whole = |v: &Value, field: &str, range: std::ops::RangeInclusive<u64>| match v.as_u64() {
        Some(n) if range.contains(&n) => Ok(()),
        _ => Err(invalid(format!(
            "{at}.{field} must be a whole number from {} to {}.",
            range.start(),
            range.end()
        ))),
    };
    let object = |v: &Value, field: &str| {
        if v.is_object() {
            Ok(())
        } else {
            Err(invalid(format!("{at}.{field} must be an object.")))
        }
    };
    for field in ["input_tokens", "output_tokens"] {
        if let Some(v) = config.get(field) {
            whole(v, field, 1..=10_000_000)?;
        }
    }
    if let Some(slo) = config.get("slo") {
        object(slo, "slo")?;
        for field in ["ttft_ms", "tpot_ms"] {
            if let Some(v) = slo.get(field) {
                match v.as_f64() {
                    Some(ms) if ms > 0.0 && ms <= 3_600_000.0 => {}
                    _ => {
                        return Err(invalid(format!(
                            "{at}.slo.{field} must be a number of milliseconds above 0 and at most 3600000."
                        )))
                    }
                }
            }
        }
        if let Some(v) = slo.get("percentile") {
            match v.as_f64() {
                Some(p) if (1.0..=99.99).contains(&p) => {}
                _ => {
                    return Err(invalid(format!(
                        "{at}.slo.percentile must be a number from 1 to 99.99 (e.g. 90)."
                    )))
                }
            }
        }
    }
    if let Some(auto) = config.get("autoscaling") {
        object(auto, "autoscaling")?;
        let max_scale = MAX_SCALE as u64;
        if let Some(v) = auto.get("min_replicas") {
            whole(v, "autoscaling.min_replicas", 0..=max_scale)?;
        }
        if let Some(v) = auto.get("max_replicas") {
            whole(v, "autoscaling.max_replicas", 1..=max_scale)?;
        }
        let number = |k: &str| auto.get(k).and_then(Value::as_u64);
        if let (Some(min), Some(max)) = (number("min_replicas"), number("max_replicas")) {
            if min > max {
                return Err(invalid(format!(
                    "{at}.autoscaling.min_replicas ({min}) is above max_replicas ({max})."
                )));
            }
        }
        if let Some(v) = auto.get("scale_to_zero_after_seconds") {
            // Kept with min_replicas above 0 too (it applies once min_replicas is 0), so that
            // a configuration can move between the two by changing one number.
            whole(
                v,
                "autoscaling.scale_to_zero_after_seconds",
                60..=7 * 24 * 3600,
            )?;
        }
    }
    Ok(())
}

fn bounded_workload_config(
    at: &str,
    config: &serde_json::Value,
) -> Result<serde_json::Value, ApiError> {
    if depth(config) > MAX_WORKLOAD_CONFIG_DEPTH {
        return Err(invalid(format!(
            "{at}.workload_config nests deeper than {MAX_WORKLOAD_CONFIG_DEPTH} levels."
        )));
    }
    if config.to_string().len() > MAX_WORKLOAD_CONFIG_BYTES {
        return Err(invalid(format!(
            "{at}.workload_config must be at most {} KiB as JSON.",
            MAX_WORKLOAD_CONFIG_BYTES / 1024
        )));
    }
    Ok(config.clone())
}

/// How many objects or arrays deep a value nests (a scalar: 0).
fn depth(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        serde_json::Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::catalog::{Catalog, EMBEDDED};

    fn input(json: serde_json::Value) -> SpecInput {
        serde_json::from_value(json).unwrap()
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "version": 1, "name": "my-di", "region": "atl1",
            "vpc": {"uuid": "7e5c619c-359c-44ca-87e2-47e98170c012"}, "enable_public_endpoint": true,
            "model_deployments": [{"model_slug": "qwen/qwen2.5-7b-instruct", "model_provider": "hugging_face",
                "accelerators": [{"scale": 2, "type": "prefill_decode", "accelerator_slug": "gpu-h100x1-80gb"}]}]
        })
    }

    fn message(spec: serde_json::Value) -> String {
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        match super::spec(&catalog, &input(spec)) {
            Err(ApiError::Unprocessable(m)) => m,
            other => panic!("expected 422, got {:?}", other.map(|c| c.spec)),
        }
    }

    #[test]
    fn accepts_both_dialects_identically() {
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        let pydo = super::spec(&catalog, &input(base())).unwrap();
        let mut godo = base();
        godo["vpc_config"] =
            serde_json::json!({"vpc_uuid": "7e5c619c-359c-44ca-87e2-47e98170c012"});
        godo.as_object_mut().unwrap().remove("vpc");
        // godo always sends provider_model_id, empty when unset; GET shows it back as sent.
        godo["model_deployments"][0]["provider_model_id"] = "".into();
        let godo = super::spec(&catalog, &input(godo)).unwrap();
        assert_eq!(pydo.spec, godo.spec);
        assert!(!pydo.gated);
        let source = &pydo.spec.model_deployments[0].source;
        assert_eq!(source.repository, "Qwen/Qwen2.5-7B-Instruct");
        assert!(!source.custom);
    }

    #[test]
    fn both_providers() {
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        let deployment = |d: serde_json::Value| {
            let mut s = base();
            s["model_deployments"] = serde_json::json!([d]);
            let checked = super::spec(&catalog, &input(s)).unwrap();
            checked.spec.model_deployments[0].clone()
        };
        let acc = serde_json::json!([{"scale": 1, "type": "prefill_decode", "accelerator_slug": "gpu-l40sx1-48gb"}]);
        // The catalog under its proper name, with or without the catalog's repository named.
        let d = deployment(serde_json::json!({"model_slug": "qwen/qwen2.5-7b-instruct",
            "model_provider": "modelcatalog", "provider_model_id": "Qwen/Qwen2.5-7B-Instruct", "accelerators": acc}));
        assert_eq!(d.model_provider, "modelcatalog");
        assert_eq!(d.provider_model_id, "Qwen/Qwen2.5-7B-Instruct");
        assert!(!d.source.custom);
        // Any repository: called by its id, or by the model_slug sent; at a revision. No
        // catalog GPU list applies (the region sizes it against the Hub's numbers).
        let d = deployment(serde_json::json!({"model_provider": "hugging_face",
            "provider_model_id": "my-org/my-finetune@v2", "accelerators": acc}));
        assert_eq!(d.model_slug, "my-org/my-finetune");
        assert_eq!(d.provider_model_id, "my-org/my-finetune@v2");
        assert_eq!(
            d.source,
            ModelSource {
                repository: "my-org/my-finetune".into(),
                revision: Some("v2".into()),
                custom: true,
                commit: None
            }
        );
        let d = deployment(
            serde_json::json!({"model_provider": "hugging_face", "model_slug": "support-bot",
            "provider_model_id": "my-org/my-finetune", "accelerators": acc}),
        );
        assert_eq!(d.model_slug, "support-bot");
        assert_eq!(d.source.revision, None);
    }

    #[test]
    fn provider_refusals_say_what_to_send() {
        let with = |d: serde_json::Value| {
            let mut s = base();
            s["model_deployments"] = serde_json::json!([d]);
            message(s)
        };
        let acc = serde_json::json!([{"scale": 1, "type": "prefill_decode", "accelerator_slug": "gpu-h100x1-80gb"}]);
        let m = with(
            serde_json::json!({"model_provider": "openai", "model_slug": "x", "accelerators": acc}),
        );
        assert!(
            m.contains("model_provider") && m.contains("modelcatalog"),
            "{m}"
        );
        let m = with(
            serde_json::json!({"model_provider": "modelcatalog", "model_slug": "my-org/x", "accelerators": acc}),
        );
        assert!(
            m.contains("model_slug") && m.contains("provider_model_id"),
            "{m}"
        );
        let m = with(
            serde_json::json!({"model_provider": "modelcatalog", "model_slug": "qwen/qwen2.5-7b-instruct",
            "provider_model_id": "other/repo", "accelerators": acc}),
        );
        assert!(
            m.contains("provider_model_id") && m.contains("Qwen/Qwen2.5-7B-Instruct"),
            "{m}"
        );
        let m = with(
            serde_json::json!({"model_provider": "hugging_face", "provider_model_id": "", "accelerators": acc}),
        );
        assert!(
            m.contains("provider_model_id") && m.contains("model_slug"),
            "{m}"
        );
        for bad in [
            "no-owner",
            "a/b/c",
            "-x/y",
            "x/y@",
            "x/y@../main",
            "x/ y",
            "x/y..z",
            "x/y@-main",
        ] {
            let m = with(
                serde_json::json!({"model_provider": "hugging_face", "provider_model_id": bad, "accelerators": acc}),
            );
            assert!(
                m.starts_with("spec.model_deployments[0].provider_model_id"),
                "{bad}: {m}"
            );
        }
        let m = with(
            serde_json::json!({"model_provider": "hugging_face", "model_slug": "-bot",
            "provider_model_id": "my-org/a", "accelerators": acc}),
        );
        assert!(m.starts_with("spec.model_deployments[0].model_slug"), "{m}");
        let mut s = base();
        let d = serde_json::json!({"model_provider": "hugging_face", "model_slug": "bot",
            "provider_model_id": "my-org/a", "accelerators": acc});
        let mut other = d.clone();
        other["provider_model_id"] = "my-org/b".into();
        s["model_deployments"] = serde_json::json!([d, other]);
        let m = message(s);
        assert!(
            m.starts_with("spec.model_deployments[1] serves \"bot\""),
            "{m}"
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let mut s = base();
        s["region"] = "ams3".into();
        assert!(message(s).starts_with("spec.region"));
        let mut s = base();
        s["model_deployments"][0]["accelerators"][0]["accelerator_slug"] = "gpu-nope".into();
        assert!(message(s).contains("accelerators[0].accelerator_slug"));
        let mut s = base();
        s["model_deployments"][0]["model_slug"] = "nobody/nothing".into();
        assert!(message(s).contains("model_deployments[0].model_slug"));
        let mut s = base();
        s["model_deployments"][0]["accelerators"][0]["accelerator_slug"] =
            "gpu-h100x8-640gb".into();
        assert!(message(s).contains("cannot serve"));
        let mut s = base();
        s["name"] = "has space".into();
        assert!(message(s).starts_with("spec.name"));
        let mut s = base();
        s["model_deployments"][0]["accelerators"][0]["scale"] = 0.into();
        assert!(message(s).contains("scale"));
    }

    #[test]
    fn workload_config_is_bounded() {
        let nested = |levels: usize| {
            (1..levels).fold(
                serde_json::json!({}),
                |inner, _| serde_json::json!({ "a": inner }),
            )
        };
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        let mut s = base();
        s["model_deployments"][0]["workload_config"] = nested(MAX_WORKLOAD_CONFIG_DEPTH);
        assert!(super::spec(&catalog, &input(s)).is_ok());
        let mut s = base();
        s["model_deployments"][0]["workload_config"] = nested(MAX_WORKLOAD_CONFIG_DEPTH + 1);
        assert!(message(s).starts_with("spec.model_deployments[0].workload_config nests deeper"));
        let mut s = base();
        s["model_deployments"][0]["workload_config"] =
            serde_json::json!({ "padding": "x".repeat(MAX_WORKLOAD_CONFIG_BYTES) });
        assert!(message(s).starts_with("spec.model_deployments[0].workload_config must be at most"));
    }

    #[test]
    fn a_declared_workload_is_checked_part_by_part() {
        let with = |config: serde_json::Value, scale: i64| {
            let mut s = base();
            s["model_deployments"][0]["workload_config"] = config;
            s["model_deployments"][0]["accelerators"][0]["scale"] = scale.into();
            s
        };
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        let full = serde_json::json!({"input_tokens": 3500, "output_tokens": 200,
            "slo": {"ttft_ms": 600, "tpot_ms": 60, "percentile": 90},
            "autoscaling": {"min_replicas": 0, "max_replicas": 4, "scale_to_zero_after_seconds": 600},
            "a_hint_of_our_own": true});
        let checked = super::spec(&catalog, &input(with(full.clone(), 2))).unwrap();
        // Kept as sent (unknown keys too), and read back typed.
        let d = &checked.spec.model_deployments[0];
        assert_eq!(d.workload_config, full);
        let w = d.workload();
        assert_eq!(w.autoscaling.unwrap().max_replicas, Some(4));
        assert_eq!(w.slo.unwrap().ttft_ms, Some(600.0));
        assert_eq!(d.declared_context(), Some(3700));
        for (config, scale, says) in [
            (
                serde_json::json!({"input_tokens": 0}),
                1,
                "workload_config.input_tokens must be a whole number",
            ),
            (
                serde_json::json!({"output_tokens": "200"}),
                1,
                "workload_config.output_tokens",
            ),
            (
                serde_json::json!({"slo": 600}),
                1,
                "workload_config.slo must be an object",
            ),
            (
                serde_json::json!({"slo": {"ttft_ms": -1}}),
                1,
                "workload_config.slo.ttft_ms",
            ),
            (
                serde_json::json!({"slo": {"percentile": 100}}),
                1,
                "workload_config.slo.percentile",
            ),
            (
                serde_json::json!({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}),
                2,
                "min_replicas (3) is above max_replicas (2)",
            ),
            (
                serde_json::json!({"autoscaling": {"max_replicas": 0}}),
                1,
                "autoscaling.max_replicas must be",
            ),
            (
                serde_json::json!({"autoscaling": {"min_replicas": 0, "scale_to_zero_after_seconds": 5}}),
                1,
                "scale_to_zero_after_seconds must be a whole number from 60",
            ),
            // The starting scale lies within the bounds.
            (
                serde_json::json!({"autoscaling": {"min_replicas": 2, "max_replicas": 4}}),
                1,
                "accelerators[0].scale is the starting replica count",
            ),
            (
                serde_json::json!({"autoscaling": {"max_replicas": 2}}),
                3,
                "(1..=2)",
            ),
        ] {
            let m = message(with(config.clone(), scale));
            assert!(m.starts_with("spec.model_deployments[0]"), "{config}: {m}");
            assert!(m.contains(says), "{config}: {m}");
        }
    }

    #[test]
    fn size_must_be_enabled_in_the_region() {
        let mut s = base();
        s["region"] = "tor1".into();
        s["model_deployments"][0]["accelerators"][0]["accelerator_slug"] =
            "gpu-h200x1-141gb".into();
        assert!(message(s).contains("not available in tor1"));
    }
}

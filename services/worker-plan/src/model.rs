//! A model deployment as the planner needs it: validated, with its id assigned and the GPU
//! facts parsed from the accelerator slug.

use api_types::spec::ModelDeployment;
use uuid::Uuid;

use super::names;

/// Why a spec cannot be planned. Every variant is a property of the input, so retrying the same
/// input cannot succeed: the worker treats all of them as permanent until the spec changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("model deployment {0:?} has no model id yet")]
    MissingModelId(String),
    #[error("model deployment {0} has no accelerators")]
    NoAccelerator(Uuid),
    #[error("model deployment {0} has {1} accelerator groups; exactly one is supported")]
    TooManyAcceleratorGroups(Uuid, usize),
    #[error("accelerator slug {0:?} is not a GPU size of the form gpu-<model>x<count>-<memory>")]
    BadAcceleratorSlug(String),
    #[error("model deployment {0} has a negative scale ({1})")]
    NegativeScale(Uuid, i32),
    #[error("model deployments {0} and {1} share the id prefix their object names use")]
    NameCollision(Uuid, Uuid),
    #[error("model deployment {0} appears twice")]
    DuplicateModel(Uuid),
    #[error("access token {0} has a hash that is not 64 hex characters")]
    BadTokenHash(Uuid),
    #[error("certificate: {0}")]
    Certificate(String),
}

/// GPU vendor, which decides the extended resource name, the DOKS taint and the vLLM image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuVendor {
    Nvidia,
    Amd,
}

impl GpuVendor {
    /// The extended resource the device plugin advertises; DOKS taints GPU nodes with the same
    /// key (`<resource>:NoSchedule`).
    pub fn resource_name(self) -> &'static str {
        match self {
            GpuVendor::Nvidia => "nvidia.com/gpu",
            GpuVendor::Amd => "amd.com/gpu",
        }
    }
}

/// GPUs per node and vendor, parsed from a slug like `gpu-h100x8-640gb` or `gpu-mi300x1-192gb`.
/// AMD Instinct parts (`mi…`, e.g. mi300x, mi325x) are the only non-NVIDIA GPUs sold.
pub fn parse_accelerator_slug(slug: &str) -> Result<(u32, GpuVendor), PlanError> {
    let bad = || PlanError::BadAcceleratorSlug(slug.to_string());
    let rest = slug.strip_prefix("gpu-").ok_or_else(bad)?;
    let (head, memory) = rest.split_once('-').ok_or_else(bad)?;
    if memory.is_empty() {
        return Err(bad());
    }
    let x = head.rfind('x').ok_or_else(bad)?;
    let (model, count) = (&head[..x], &head[x + 1..]);
    if model.is_empty() || count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let gpus: u32 = count.parse().map_err(|_| bad())?;
    if gpus == 0 {
        return Err(bad());
    }
    let vendor = if model.starts_with("mi") {
        GpuVendor::Amd
    } else {
        GpuVendor::Nvidia
    };
    Ok((gpus, vendor))
}

/// One model deployment, ready to plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    pub model_id: Uuid,
    /// The name vLLM serves the model under (`--served-model-name`): what clients send as
    /// `model`.
    pub model_slug: String,
    /// The Hugging Face repository vLLM loads (`--model`), at `revision` (`--revision`) when
    /// there is one: the commit the region pinned, so that every replica, whenever it starts,
    /// loads the same weights; else the revision named (specs stored before commits were
    /// pinned, catalog models); else the default branch.
    pub repository: String,
    pub revision: Option<String>,
    pub accelerator_slug: String,
    pub role: String,
    /// Replicas: one pod per node, each pod taking every GPU of its node.
    pub scale: u32,
    pub gpus_per_node: u32,
    pub vendor: GpuVendor,
    /// Whether the deployment may scale to zero replicas (`autoscaling.min_replicas` 0): its
    /// gateway then holds requests while a replica starts (the EPP's flow control).
    pub scales_to_zero: bool,
}

impl Model {
    pub fn from_deployment(md: &ModelDeployment) -> Result<Self, PlanError> {
        let model_id = md
            .model_id
            .ok_or_else(|| PlanError::MissingModelId(md.model_slug.clone()))?;
        let group = match md.accelerators.as_slice() {
            [] => return Err(PlanError::NoAccelerator(model_id)),
            [g] => g,
            more => return Err(PlanError::TooManyAcceleratorGroups(model_id, more.len())),
        };
        let scale = u32::try_from(group.scale)
            .map_err(|_| PlanError::NegativeScale(model_id, group.scale))?;
        let (gpus_per_node, vendor) = parse_accelerator_slug(&group.accelerator_slug)?;
        Ok(Model {
            model_id,
            model_slug: md.model_slug.clone(),
            // Specs stored before sources existed loaded their slug.
            repository: if md.source.repository.is_empty() {
                md.model_slug.clone()
            } else {
                md.source.repository.clone()
            },
            revision: md.source.loaded_revision().map(str::to_string),
            accelerator_slug: group.accelerator_slug.clone(),
            role: group.role.clone(),
            scale,
            gpus_per_node,
            vendor,
            scales_to_zero: md
                .workload()
                .autoscaling
                .is_some_and(|a| a.min_replicas == Some(0)),
        })
    }
}

/// Validates a spec's model deployments, keeping their order (the first one is the default
/// route). Rejects two deployments whose ids would give the same object names.
pub fn models(deployments: &[ModelDeployment]) -> Result<Vec<Model>, PlanError> {
    let models = deployments
        .iter()
        .map(Model::from_deployment)
        .collect::<Result<Vec<_>, _>>()?;
    for (i, a) in models.iter().enumerate() {
        for b in &models[..i] {
            if a.model_id == b.model_id {
                return Err(PlanError::DuplicateModel(a.model_id));
            }
            if names::short(&a.model_id) == names::short(&b.model_id) {
                return Err(PlanError::NameCollision(b.model_id, a.model_id));
            }
        }
    }
    Ok(models)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use api_types::spec::AcceleratorGroup;

    pub(crate) fn deployment(id: &str, slug: &str, accel: &str, scale: i32) -> ModelDeployment {
        ModelDeployment {
            model_id: Some(id.parse().unwrap()),
            model_slug: slug.into(),
            model_provider: "hugging_face".into(),
            provider_model_id: String::new(),
            source: api_types::spec::ModelSource::default(),
            workload_config: serde_json::json!({}),
            accelerators: vec![AcceleratorGroup {
                accelerator_slug: accel.into(),
                role: "prefill_decode".into(),
                scale,
            }],
        }
    }

    #[test]
    fn tensor_parallel_size_comes_from_the_slug() {
        assert_eq!(
            parse_accelerator_slug("gpu-h100x8-640gb"),
            Ok((8, GpuVendor::Nvidia))
        );
        assert_eq!(
            parse_accelerator_slug("gpu-h100x1-80gb"),
            Ok((1, GpuVendor::Nvidia))
        );
        assert_eq!(
            parse_accelerator_slug("gpu-4000adax1-20gb"),
            Ok((1, GpuVendor::Nvidia))
        );
    }

    #[test]
    fn mi300x_and_mi325x_are_amd() {
        assert_eq!(
            parse_accelerator_slug("gpu-mi300x1-192gb"),
            Ok((1, GpuVendor::Amd))
        );
        assert_eq!(
            parse_accelerator_slug("gpu-mi300x8-1536gb"),
            Ok((8, GpuVendor::Amd))
        );
        assert_eq!(
            parse_accelerator_slug("gpu-mi325x1-256gb"),
            Ok((1, GpuVendor::Amd))
        );
        assert_eq!(GpuVendor::Amd.resource_name(), "amd.com/gpu");
    }

    #[test]
    fn malformed_slugs_are_rejected() {
        for s in [
            "s-2vcpu-4gb",
            "gpu-h100-80gb",
            "gpu-h100x0-80gb",
            "gpu-h100x8",
            "gpu-x8-80gb",
            "gpu-h100x8-",
        ] {
            assert!(parse_accelerator_slug(s).is_err(), "{s}");
        }
    }

    #[test]
    fn model_needs_id_and_exactly_one_group() {
        let mut d = deployment(
            "11111111-0000-4000-8000-000000000001",
            "m",
            "gpu-h100x1-80gb",
            1,
        );
        assert!(Model::from_deployment(&d).is_ok());
        d.accelerators.push(d.accelerators[0].clone());
        assert!(matches!(
            Model::from_deployment(&d),
            Err(PlanError::TooManyAcceleratorGroups(_, 2))
        ));
        d.accelerators.clear();
        assert!(matches!(
            Model::from_deployment(&d),
            Err(PlanError::NoAccelerator(_))
        ));
        d.model_id = None;
        assert!(matches!(
            Model::from_deployment(&d),
            Err(PlanError::MissingModelId(_))
        ));
        let neg = deployment(
            "11111111-0000-4000-8000-000000000001",
            "m",
            "gpu-h100x1-80gb",
            -1,
        );
        assert!(matches!(
            Model::from_deployment(&neg),
            Err(PlanError::NegativeScale(_, -1))
        ));
    }

    #[test]
    fn colliding_name_prefixes_are_rejected() {
        let a = deployment(
            "11111111-0000-4000-8000-000000000001",
            "a",
            "gpu-h100x1-80gb",
            1,
        );
        let b = deployment(
            "11111111-0000-4000-8000-000000000002",
            "b",
            "gpu-h100x1-80gb",
            1,
        );
        assert!(matches!(
            models(&[a.clone(), b]),
            Err(PlanError::NameCollision(_, _))
        ));
        assert!(matches!(
            models(&[a.clone(), a]),
            Err(PlanError::DuplicateModel(_))
        ));
    }
}

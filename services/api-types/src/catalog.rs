//! The catalog: regions, GPU sizes with prices and GPU memory, the models of the model catalog
//! (`modelcatalog`: which GPUs each runs on, and the Hugging Face repository it loads), and the
//! model architectures the model server (vLLM) serves, which decides which Hugging Face
//! repositories a customer may bring. It is a data file in the repository
//! (`catalog/catalog.json`), embedded at build time and replaceable at run time; nothing about
//! sizes or models is hard-coded. Central validates requests against it; the regional service
//! sizes customers' own models against its GPUs.

use serde::Deserialize;

pub const EMBEDDED: &str = include_str!("../../../catalog/catalog.json");

#[derive(Debug, Clone, Deserialize)]
pub struct Catalog {
    pub regions: Vec<String>,
    pub sizes: Vec<Size>,
    pub models: Vec<Model>,
    /// `config.json` `architectures` the model server can load; a Hugging Face repository of
    /// another architecture is refused at the API.
    pub vllm_architectures: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Size {
    pub gpu_slug: String,
    pub price_per_hour: String,
    pub currency: String,
    pub regions: Vec<String>,
    pub gpu: Gpu,
}

/// The GPUs of one node of a size.
#[derive(Debug, Clone, Deserialize)]
pub struct Gpu {
    pub count: u32,
    /// Memory per GPU, GiB.
    pub vram_gb: u32,
    pub slug: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Model {
    pub model_slug: String,
    pub model_name: String,
    pub is_gated_model: bool,
    pub gpu_slugs: Vec<String>,
    /// The Hugging Face repository the model server loads for this catalog model.
    pub hugging_face_repo: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("the catalog is not valid JSON of the expected shape: {0}")]
    Shape(#[from] serde_json::Error),
    #[error("{0}")]
    Dangling(String),
}

impl Catalog {
    pub fn parse(text: &str) -> Result<Catalog, CatalogError> {
        let catalog: Catalog = serde_json::from_str(text)?;
        for size in &catalog.sizes {
            if let Some(r) = size.regions.iter().find(|r| !catalog.regions.contains(r)) {
                return Err(CatalogError::Dangling(format!(
                    "size {} names unknown region {r}",
                    size.gpu_slug
                )));
            }
            if size.gpu.count == 0 || size.gpu.vram_gb == 0 {
                return Err(CatalogError::Dangling(format!(
                    "size {} has no GPU memory",
                    size.gpu_slug
                )));
            }
        }
        for model in &catalog.models {
            if let Some(g) = model.gpu_slugs.iter().find(|g| catalog.size(g).is_none()) {
                return Err(CatalogError::Dangling(format!(
                    "model {} names unknown size {g}",
                    model.model_slug
                )));
            }
        }
        Ok(catalog)
    }

    pub fn size(&self, slug: &str) -> Option<&Size> {
        self.sizes.iter().find(|s| s.gpu_slug == slug)
    }

    pub fn model(&self, slug: &str) -> Option<&Model> {
        self.models
            .iter()
            .find(|m| m.model_slug.eq_ignore_ascii_case(slug))
    }

    pub fn has_region(&self, region: &str) -> bool {
        self.regions.iter().any(|r| r == region)
    }

    pub fn serves_architecture(&self, architecture: &str) -> bool {
        self.vllm_architectures.iter().any(|a| a == architecture)
    }
}

impl Size {
    /// GPU memory of one node, GiB.
    pub fn node_vram_gb(&self) -> u32 {
        self.gpu.count * self.gpu.vram_gb
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_catalog_is_consistent() {
        let catalog = Catalog::parse(EMBEDDED).unwrap();
        assert!(
            catalog.has_region("atl1") && catalog.has_region("nyc2") && catalog.has_region("tor1")
        );
        assert!(catalog.models.iter().any(|m| m.is_gated_model));
        assert!(catalog.models.iter().any(|m| !m.is_gated_model));
        // Every catalog model is served from a repository of an architecture the server loads.
        assert!(catalog
            .models
            .iter()
            .all(|m| m.hugging_face_repo.contains('/')));
        assert!(catalog.serves_architecture("LlamaForCausalLM"));
    }

    #[test]
    fn rejects_dangling_references() {
        let bad = r#"{"regions":["atl1"],"vllm_architectures":[],"sizes":[{"gpu_slug":"g","price_per_hour":"1","currency":"USD","regions":["xx1"],"gpu":{"count":1,"vram_gb":80,"slug":"h100"}}],"models":[]}"#;
        assert!(Catalog::parse(bad).is_err());
    }
}

//! The catalog: regions, GPU sizes with prices, and which models run on which GPUs. It is a data
//! file in the repository (`catalog/catalog.json`), embedded at build time and replaceable at run
//! time with `--catalog`; nothing about sizes or models is hard-coded.

use serde::Deserialize;

pub const EMBEDDED: &str = include_str!("../../../catalog/catalog.json");

#[derive(Debug, Clone, Deserialize)]
pub struct Catalog {
    pub regions: Vec<String>,
    pub sizes: Vec<Size>,
    pub models: Vec<Model>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Size {
    pub gpu_slug: String,
    pub price_per_hour: String,
    pub currency: String,
    pub regions: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Model {
    pub model_slug: String,
    pub model_name: String,
    pub is_gated_model: bool,
    pub gpu_slugs: Vec<String>,
}

impl Catalog {
    pub fn parse(text: &str) -> anyhow::Result<Catalog> {
        let catalog: Catalog = serde_json::from_str(text)?;
        for size in &catalog.sizes {
            if let Some(r) = size.regions.iter().find(|r| !catalog.regions.contains(r)) {
                anyhow::bail!("size {} names unknown region {r}", size.gpu_slug);
            }
        }
        for model in &catalog.models {
            if let Some(g) = model.gpu_slugs.iter().find(|g| catalog.size(g).is_none()) {
                anyhow::bail!("model {} names unknown size {g}", model.model_slug);
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
    }

    #[test]
    fn rejects_dangling_references() {
        let bad = r#"{"regions":["atl1"],"sizes":[{"gpu_slug":"g","price_per_hour":"1","currency":"USD","regions":["xx1"]}],"models":[]}"#;
        assert!(Catalog::parse(bad).is_err());
    }
}

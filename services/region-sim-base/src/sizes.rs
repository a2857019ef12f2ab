//! Droplet size slugs: what hardware a node of a given size has.
//!
//! Only the facts the simulation needs are derived (GPU brand and count, vCPUs, memory); they are
//! parsed from the slug so that new slugs of the same shape work without a table.

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SizeInfo {
    pub slug: String,
    /// `nvidia` or `amd` for GPU sizes.
    pub gpu_brand: Option<&'static str>,
    /// GPU model as DOKS labels it (`h100`, `mi300x`, ...).
    pub gpu_model: Option<String>,
    /// GPUs per node.
    pub gpus: u32,
    pub vcpus: u32,
    pub memory_gib: u32,
}

impl SizeInfo {
    pub fn is_gpu(&self) -> bool {
        self.gpus > 0
    }

    /// The extended resource name the device plugin advertises.
    pub fn gpu_resource(&self) -> Option<&'static str> {
        match self.gpu_brand {
            Some("amd") => Some("amd.com/gpu"),
            Some(_) => Some("nvidia.com/gpu"),
            None => None,
        }
    }
}

/// Parses a size slug. Returns `None` for slugs that do not look like a DigitalOcean size.
pub fn parse(slug: &str) -> Option<SizeInfo> {
    if let Some(rest) = slug.strip_prefix("gpu-") {
        // gpu-<model>x<count>-<memory>, e.g. gpu-h100x8-640gb, gpu-4000adax1-20gb.
        let (head, _mem) = rest.split_once('-')?;
        let xpos = head.rfind('x')?;
        let (model, count) = (&head[..xpos], &head[xpos + 1..]);
        let gpus: u32 = count.parse().ok()?;
        if model.is_empty() || gpus == 0 {
            return None;
        }
        // AMD Instinct parts are the only non-NVIDIA GPUs DigitalOcean sells.
        let brand = if model.starts_with("mi") {
            "amd"
        } else {
            "nvidia"
        };
        return Some(SizeInfo {
            slug: slug.to_string(),
            gpu_brand: Some(brand),
            gpu_model: Some(model.to_string()),
            gpus,
            vcpus: 20 * gpus,
            memory_gib: 240 * gpus,
        });
    }
    // CPU slugs: s-2vcpu-4gb, c-4, g-8vcpu-32gb, m-2vcpu-16gb, so-..., c2-..., gd-...
    let mut parts = slug.split('-');
    let family = parts.next()?;
    if family.is_empty() || !family.chars().all(|c| c.is_ascii_alphanumeric()) {
        return None;
    }
    let mut vcpus = None;
    let mut memory = None;
    for p in parts {
        if let Some(n) = p.strip_suffix("vcpu") {
            vcpus = n.parse().ok();
        } else if let Some(n) = p.strip_suffix("gb") {
            memory = n.parse().ok();
        } else if let Ok(n) = p.parse::<u32>() {
            // c-4 style: the number is the vCPU count.
            vcpus = Some(n);
        } else if !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') {
            return None;
        }
    }
    let vcpus = vcpus.unwrap_or(2);
    Some(SizeInfo {
        slug: slug.to_string(),
        gpu_brand: None,
        gpu_model: None,
        gpus: 0,
        vcpus,
        memory_gib: memory.unwrap_or(vcpus * 2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_slugs() {
        let h = parse("gpu-h100x8-640gb").unwrap();
        assert_eq!(
            (h.gpus, h.gpu_brand, h.gpu_model.as_deref()),
            (8, Some("nvidia"), Some("h100"))
        );
        assert_eq!(h.gpu_resource(), Some("nvidia.com/gpu"));
        let a = parse("gpu-mi300x1-192gb").unwrap();
        assert_eq!((a.gpus, a.gpu_brand), (1, Some("amd")));
        assert_eq!(a.gpu_resource(), Some("amd.com/gpu"));
        assert_eq!(parse("gpu-mi325x1-256gb").unwrap().gpu_brand, Some("amd"));
        assert_eq!(
            parse("gpu-l40sx1-48gb").unwrap().gpu_model.as_deref(),
            Some("l40s")
        );
        assert_eq!(parse("gpu-4000adax1-20gb").unwrap().gpus, 1);
        assert!(parse("gpu-h100").is_none());
    }

    #[test]
    fn cpu_slugs() {
        let s = parse("s-2vcpu-4gb").unwrap();
        assert_eq!((s.gpus, s.vcpus, s.memory_gib), (0, 2, 4));
        assert_eq!(parse("c-4").unwrap().vcpus, 4);
        assert!(parse("").is_none());
        assert!(parse("no such size!").is_none());
    }
}

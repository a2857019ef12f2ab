//! Reads: a DI and the lists of a team from central's read model; its accelerators, CA, tokens,
//! events and quotas from the owning region; sizes and model configurations from the catalog.

use super::*;

impl App {
    pub async fn get(&self, p: &Principal, id: Uuid) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let body = owned.body.as_deref().ok_or(ApiError::NotFound)?;
        // The stored body is already the public JSON: wrap it without re-serialising.
        let mut out = Vec::with_capacity(body.len() + 26);
        out.extend_from_slice(b"{\"dedicated_inference\":");
        out.extend_from_slice(body.as_bytes());
        out.push(b'}');
        Ok(Reply {
            status: StatusCode::OK,
            body: out,
        })
    }

    pub async fn list(
        &self,
        p: &Principal,
        region: Option<&str>,
        name: Option<&str>,
        paging: Paging,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        if let Some(region) = region {
            validate::region(&self.catalog, "region", region)?;
        }
        let (bodies, total) = self
            .store
            .dedicated_inference_list(p.team_id, region, name, paging.page, paging.per_page)
            .await?;
        let mut extra = Vec::new();
        if let Some(r) = region {
            extra.push(("region", r));
        }
        if let Some(n) = name {
            extra.push(("name", n));
        }
        let links = self.links("/v2/dedicated-inferences", paging, total, &extra);
        let mut out = Vec::with_capacity(bodies.iter().map(String::len).sum::<usize>() + 256);
        out.extend_from_slice(b"{\"dedicated_inferences\":[");
        for (i, body) in bodies.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(body.as_bytes());
        }
        out.extend_from_slice(b"],\"links\":");
        out.extend_from_slice(&serde_json::to_vec(&links).expect("serialises"));
        out.extend_from_slice(b",\"meta\":");
        out.extend_from_slice(&serde_json::to_vec(&Meta { total }).expect("serialises"));
        out.push(b'}');
        Ok(Reply {
            status: StatusCode::OK,
            body: out,
        })
    }

    pub async fn accelerators(
        &self,
        p: &Principal,
        id: Uuid,
        slug: Option<&str>,
        paging: Paging,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let query = PageQuery {
            slug: slug.map(str::to_string),
            ..paging.of(p.team_id)
        };
        let page = self
            .regions
            .accelerators(&owned.region, id, &query)
            .await
            .map_err(region_error)?;
        let extra: Vec<(&str, &str)> = slug.map(|s| vec![("slug", s)]).unwrap_or_default();
        Ok(Reply::json(
            StatusCode::OK,
            &AcceleratorList {
                accelerators: page.items.iter().map(AcceleratorInfo::from).collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/accelerators"),
                    paging,
                    page.total,
                    &extra,
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub async fn accelerator(
        &self,
        p: &Principal,
        id: Uuid,
        accelerator_id: Uuid,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let a = self
            .regions
            .accelerator(&owned.region, id, accelerator_id, &team(p))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(StatusCode::OK, &AcceleratorInfo::from(&a)))
    }

    pub async fn ca(&self, p: &Principal, id: Uuid) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let ca = self
            .regions
            .ca_certificate(&owned.region, id, &team(p))
            .await
            .map_err(region_error)?;
        let cert = base64::engine::general_purpose::STANDARD.encode(ca.cert_pem.as_bytes());
        Ok(Reply::json(StatusCode::OK, &CaResponse { cert }))
    }

    pub async fn tokens(&self, p: &Principal, id: Uuid, paging: Paging) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:read")?;
        let owned = self.owned(p, id).await?;
        let page = self
            .regions
            .tokens(&owned.region, id, &paging.of(p.team_id))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(
            StatusCode::OK,
            &TokenList {
                tokens: page.items.iter().map(AccessToken::from).collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/tokens"),
                    paging,
                    page.total,
                    &[],
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub async fn events(&self, p: &Principal, id: Uuid, paging: Paging) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let page = self
            .regions
            .events(&owned.region, id, &paging.of(p.team_id))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(
            StatusCode::OK,
            &EventList {
                events: page
                    .items
                    .into_iter()
                    .map(|e| EventInfo {
                        id: e.id,
                        phase: e.phase,
                        reason: e.reason,
                        message: e.message,
                        time: e.created_at,
                    })
                    .collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/events"),
                    paging,
                    page.total,
                    &[],
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub fn sizes(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let mut sizes = Vec::new();
        for size in &self.catalog.sizes {
            for region in &size.regions {
                sizes.push(Size {
                    gpu_slug: size.gpu_slug.clone(),
                    price_per_hour: size.price_per_hour.clone(),
                    region: region.clone(),
                    regions: size.regions.clone(),
                    currency: size.currency.clone(),
                    gpu: SizeGpu {
                        count: size.gpu.count,
                        vram_gb: size.gpu.vram_gb,
                        slug: size.gpu.slug.clone(),
                    },
                });
            }
        }
        Ok(Reply::json(
            StatusCode::OK,
            &SizesResponse {
                enabled_regions: self.catalog.regions.clone(),
                sizes,
            },
        ))
    }

    /// The team's quotas in every region, asked of all at once; a region that does not answer
    /// is listed as such rather than failing the others.
    pub async fn quotas(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let names = self.regions.names();
        let query = team(p);
        let answers = futures::future::join_all(
            names
                .iter()
                .map(|region| self.regions.quotas(region, &query)),
        )
        .await;
        let mut body = QuotasResponse {
            quotas: Vec::new(),
            unavailable_regions: Vec::new(),
        };
        for (region, answer) in names.into_iter().zip(answers) {
            match answer {
                Ok(quotas) => body.quotas.push(quotas),
                Err(error) => {
                    tracing::warn!(%region, ?error, "a region's quotas are unavailable");
                    body.unavailable_regions.push(region);
                }
            }
        }
        Ok(Reply::json(StatusCode::OK, &body))
    }

    pub fn gpu_model_config(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let gpu_model_configs = self
            .catalog
            .models
            .iter()
            .map(|m| GpuModelConfig {
                gpu_slugs: m.gpu_slugs.clone(),
                model_slug: m.model_slug.clone(),
                model_name: m.model_name.clone(),
                is_gated_model: m.is_gated_model,
                is_model_gated: m.is_gated_model,
            })
            .collect();
        Ok(Reply::json(
            StatusCode::OK,
            &GpuModelConfigsResponse { gpu_model_configs },
        ))
    }
}

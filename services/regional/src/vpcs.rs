//! Which VPC a dedicated inference lands in, asked of the region's DigitalOcean API.
//!
//! A team is a DigitalOcean account (the same UUID). The regional service holds the platform's
//! DigitalOcean credential and acts for the team ([`DoClient::acting_for`]): a VPC the team can
//! read in this region is its own, any other (another team's, another region's, none at all) is
//! not found, and a create without a VPC gets the team's default VPC here, which DigitalOcean
//! makes on the account's first use of the region. The answer is given before anything is
//! stored, so a wrong VPC is a `422` at once rather than an `error` later.

use std::time::Duration;

use cloud_clients::digitalocean::{DoClient, DoClientOptions, DoError};
use common::errors::{Classify, ErrorClass};
use uuid::Uuid;

use crate::ApiError;

#[derive(Clone, Debug)]
pub struct Vpcs {
    api: DoClient,
    region: String,
}

impl Vpcs {
    /// A lookup against `base_url` with the platform's `token`. Calls are retried briefly: the
    /// whole answer must arrive well inside central's wait for the region.
    pub fn new(region: &str, base_url: &str, token: &str) -> anyhow::Result<Vpcs> {
        let options = DoClientOptions {
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            retry: crate::retry_within_a_request(),
            ..DoClientOptions::default()
        };
        Ok(Vpcs {
            api: DoClient::with_options(base_url, token, options)?,
            region: region.to_string(),
        })
    }

    /// The VPC a create of `team` uses: `requested` when the team owns it in this region, else
    /// (when none is requested) the team's default VPC here.
    pub async fn resolve(&self, team: Uuid, requested: Option<Uuid>) -> Result<Uuid, ApiError> {
        let api = self.api.acting_for(team);
        match requested {
            Some(id) => {
                let here = match api.vpc_get(&id.to_string()).await {
                    Ok(vpc) => vpc.region == self.region,
                    Err(e) => match e.class() {
                        ErrorClass::NotFound => false,
                        ErrorClass::Transient { .. }
                        | ErrorClass::Conflict
                        | ErrorClass::Unauthorized
                        | ErrorClass::Refused
                        | ErrorClass::Permanent => return Err(unavailable(e)),
                    },
                };
                if here {
                    return Ok(id);
                }
                // A wrong API address answers 404 too: only when the team's own list works
                // is the VPC really not the team's (a refusal is final for the create).
                api.vpc_list().await.map_err(unavailable)?;
                Err(ApiError::Unprocessable(format!(
                    "spec.vpc.uuid {id} is not one of your VPCs in {}.",
                    self.region
                )))
            }
            None => {
                let vpcs = api.vpc_list().await.map_err(unavailable)?;
                vpcs.iter()
                    .find(|v| v.default && v.region == self.region)
                    .and_then(|v| Uuid::parse_str(&v.id).ok())
                    // An account whose default VPC in the region is not made yet: a retry
                    // would not change that, so the customer is told what to send.
                    .ok_or_else(|| {
                        ApiError::Unprocessable(format!(
                            "spec.vpc.uuid is required: you have no default VPC in {} yet; name one of your VPCs there.",
                            self.region
                        ))
                    })
            }
        }
    }
}

/// Any failure of a lookup but the VPC's absence, whatever its class, is a 503: the lookup is
/// the platform's own request, with its own credential, so nothing the customer sent was refused
/// (a retry works once the cloud or the credential does), and nothing was stored.
fn unavailable(e: DoError) -> ApiError {
    ApiError::Unavailable(format!("DigitalOcean VPC lookup: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::Path;
    use axum::http::StatusCode;
    use axum::routing::get;
    use serde_json::json;

    const REGION: &str = "atl1";

    /// A DigitalOcean API whose `GET /v2/vpcs/{id}` answers `status` (200: a VPC in `region`),
    /// and whose VPC list works.
    async fn cloud(status: u16, region: &'static str) -> Vpcs {
        let one = move |Path(id): Path<String>| async move {
            let status = StatusCode::from_u16(status).unwrap();
            if status.is_success() {
                return (
                    status,
                    axum::Json(json!({"vpc": {"id": id, "region": region}})),
                );
            }
            (status, axum::Json(json!({"id": "x", "message": "no"})))
        };
        let list = || async { axum::Json(json!({"vpcs": [], "links": {}})) };
        let app = axum::Router::new()
            .route("/v2/vpcs/{id}", get(one))
            .route("/v2/vpcs", get(list));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Vpcs::new(REGION, &url, "token").unwrap()
    }

    /// Only the VPC's absence is the customer's to hear about (a 422 naming the field); every
    /// other failure, whatever its class, is a 503 that stores nothing.
    #[tokio::test]
    async fn only_a_missing_vpc_is_the_customers() {
        let (team, vpc) = (Uuid::new_v4(), Uuid::new_v4());
        let here = cloud(200, REGION).await;
        assert_eq!(here.resolve(team, Some(vpc)).await.unwrap(), vpc);
        for (status, region) in [(404, REGION), (200, "nyc2")] {
            let answer = cloud(status, region).await.resolve(team, Some(vpc)).await;
            assert!(
                matches!(&answer, Err(ApiError::Unprocessable(m)) if m.contains("spec.vpc.uuid")),
                "{status} {region}: {answer:?}"
            );
        }
        // Unauthorized, Unauthorized, Conflict, Refused, Refused, Transient.
        for status in [401, 403, 409, 400, 422, 503] {
            let answer = cloud(status, REGION).await.resolve(team, Some(vpc)).await;
            assert!(
                matches!(answer, Err(ApiError::Unavailable(_))),
                "{status}: {answer:?}"
            );
        }
    }
}

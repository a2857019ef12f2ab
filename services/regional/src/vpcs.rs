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
            Some(id) => match api.vpc_get(&id.to_string()).await {
                Ok(vpc) if vpc.region == self.region => Ok(id),
                Ok(_) | Err(DoError::NotFound { .. }) => {
                    // A wrong API address answers 404 too: only when the team's own list works
                    // is the VPC really not the team's (a refusal is final for the create).
                    api.vpc_list().await.map_err(unavailable)?;
                    Err(ApiError::Unprocessable(format!(
                        "spec.vpc.uuid {id} is not one of your VPCs in {}.",
                        self.region
                    )))
                }
                Err(e) => Err(unavailable(e)),
            },
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

fn unavailable(e: DoError) -> ApiError {
    ApiError::Unavailable(format!("DigitalOcean VPC lookup: {e}"))
}

//! API tokens: a team's tokens by the hash of their value (never the value itself), listed for
//! operators without it, and revoked.

use uuid::Uuid;

use crate::{CentralStore, Result, StoreError};

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApiToken {
    pub id: Uuid,
    pub team_id: Uuid,
    pub scopes: Vec<String>,
    pub rate_limit_per_hour: Option<i32>,
    pub revoked: bool,
}

/// An API token as operators list it: never its value or its hash.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApiTokenListing {
    pub id: Uuid,
    pub name: String,
    pub scopes: Vec<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl CentralStore {
    pub async fn api_token_create(
        &self,
        team_id: Uuid,
        name: &str,
        token_hash: &[u8],
        scopes: &[String],
        rate_limit_per_hour: Option<i32>,
    ) -> Result<Uuid> {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO api_tokens (id, team_id, name, token_hash, scopes, rate_limit_per_hour) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(team_id)
        .bind(name)
        .bind(token_hash)
        .bind(scopes)
        .bind(rate_limit_per_hour)
        .execute(&self.pool)
        .await?;
        Ok(id)
    }

    pub async fn api_token_by_hash(&self, token_hash: &[u8]) -> Result<Option<ApiToken>> {
        Ok(sqlx::query_as(
            "SELECT id, team_id, scopes, rate_limit_per_hour, revoked_at IS NOT NULL AS revoked FROM api_tokens WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// A team's API tokens, revoked ones included, oldest first.
    pub async fn api_tokens_of_team(&self, team_id: Uuid) -> Result<Vec<ApiTokenListing>> {
        Ok(sqlx::query_as(
            "SELECT id, name, scopes, created_at, revoked_at FROM api_tokens WHERE team_id = $1 ORDER BY created_at, id",
        )
        .bind(team_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// `NotFound` when no token has this id or it is revoked already.
    pub async fn api_token_revoke(&self, id: Uuid) -> Result<()> {
        let done = sqlx::query(
            "UPDATE api_tokens SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }
}

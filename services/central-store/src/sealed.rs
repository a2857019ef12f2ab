//! Sealed values, wherever central keeps them (a pending create's intent, a create's first
//! response, an idempotency key's response or operation): walked and replaced for a key
//! rotation, and erased when the DI they are about is gone.

use uuid::Uuid;

use crate::{CentralStore, Result};

/// Where central keeps a sealed value; what it names is what the value was sealed for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SealedAt {
    /// A pending create's intent.
    CreateIntent { di_id: Uuid },
    /// A create's first response, kept for identical retries.
    CreateResponse { di_id: Uuid, team_id: Uuid },
    /// The response an idempotency key replays.
    KeyResponse { team_id: Uuid, key: String },
    /// The operation an unfinished idempotency key re-drives.
    KeyOperation { team_id: Uuid, key: String },
}

impl SealedAt {
    /// Where a walk over each kind of sealed value starts (before the first of its kind).
    pub fn starts() -> [SealedAt; 4] {
        let (nil, key) = (Uuid::nil(), String::new());
        [
            SealedAt::CreateIntent { di_id: nil },
            SealedAt::CreateResponse {
                di_id: nil,
                team_id: nil,
            },
            SealedAt::KeyResponse {
                team_id: nil,
                key: key.clone(),
            },
            SealedAt::KeyOperation { team_id: nil, key },
        ]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedValue {
    pub at: SealedAt,
    pub sealed: Vec<u8>,
}

impl CentralStore {
    /// Up to `limit` sealed values of the kind of `after` that come after it (in a fixed order)
    /// and do not begin with `prefix`: those a key rotation still has to re-seal.
    pub async fn sealed_values_after(
        &self,
        after: &SealedAt,
        prefix: &[u8],
        limit: i64,
    ) -> Result<Vec<SealedValue>> {
        let len = prefix.len() as i32;
        Ok(match after {
            SealedAt::CreateIntent { di_id } | SealedAt::CreateResponse { di_id, .. } => {
                let intent = matches!(after, SealedAt::CreateIntent { .. });
                let (from, id, column) = if intent {
                    (
                        "pending_creates p JOIN dedicated_inferences d ON d.id = p.di_id",
                        "p.di_id",
                        "p.sealed",
                    )
                } else {
                    ("dedicated_inferences d", "d.id", "d.create_response")
                };
                sqlx::query_as::<_, (Uuid, Uuid, Vec<u8>)>(&format!(
                    "SELECT {id}, d.team_id, {column} FROM {from}
                     WHERE {column} IS NOT NULL AND {id} > $1 AND substring({column} from 1 for $2) <> $3
                     ORDER BY {id} LIMIT $4"
                ))
                .bind(di_id)
                .bind(len)
                .bind(prefix)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
                .into_iter()
                .map(|(di_id, team_id, sealed)| SealedValue {
                    at: if intent {
                        SealedAt::CreateIntent { di_id }
                    } else {
                        SealedAt::CreateResponse { di_id, team_id }
                    },
                    sealed,
                })
                .collect()
            }
            SealedAt::KeyResponse { team_id, key } | SealedAt::KeyOperation { team_id, key } => {
                let operation = matches!(after, SealedAt::KeyOperation { .. });
                let column = if operation {
                    "sealed_operation"
                } else {
                    "sealed_body"
                };
                sqlx::query_as::<_, (Uuid, String, Vec<u8>)>(&format!(
                    "SELECT team_id, key, {column} FROM idempotency_keys
                     WHERE {column} IS NOT NULL AND (team_id, key) > ($1, $2)
                       AND substring({column} from 1 for $3) <> $4
                     ORDER BY team_id, key LIMIT $5"
                ))
                .bind(team_id)
                .bind(key)
                .bind(len)
                .bind(prefix)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
                .into_iter()
                .map(|(team_id, key, sealed)| SealedValue {
                    at: if operation {
                        SealedAt::KeyOperation { team_id, key }
                    } else {
                        SealedAt::KeyResponse { team_id, key }
                    },
                    sealed,
                })
                .collect()
            }
        })
    }

    /// Puts `resealed` in place of `value`, unless the value changed meanwhile (false then).
    pub async fn sealed_value_replace(&self, value: &SealedValue, resealed: &[u8]) -> Result<bool> {
        let query = match &value.at {
            SealedAt::CreateIntent { di_id } => {
                sqlx::query("UPDATE pending_creates SET sealed = $3 WHERE di_id = $1 AND sealed = $2")
                    .bind(di_id)
            }
            SealedAt::CreateResponse { di_id, .. } => sqlx::query(
                "UPDATE dedicated_inferences SET create_response = $3 WHERE id = $1 AND create_response = $2",
            )
            .bind(di_id),
            SealedAt::KeyResponse { team_id, key } => sqlx::query(
                "UPDATE idempotency_keys SET sealed_body = $4 WHERE team_id = $1 AND key = $2 AND sealed_body = $3",
            )
            .bind(team_id)
            .bind(key),
            SealedAt::KeyOperation { team_id, key } => sqlx::query(
                "UPDATE idempotency_keys SET sealed_operation = $4 WHERE team_id = $1 AND key = $2 AND sealed_operation = $3",
            )
            .bind(team_id)
            .bind(key),
        };
        Ok(query
            .bind(&value.sealed)
            .bind(resealed)
            .execute(&self.pool)
            .await?
            .rows_affected()
            == 1)
    }
}

/// What central keeps sealed about a DI goes when the DI does: the create's intent and its
/// first response (both hold the managed token's value, the intent the Hugging Face token), and
/// the responses and operations of its idempotency keys (minted tokens, Hugging Face tokens).
/// The keys stay, answered, so that none of their requests runs again; a keyed operation
/// still in flight is over (the region would refuse it now) and its key goes.
pub(super) async fn erase_secrets(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: Uuid,
) -> Result<()> {
    sqlx::query("DELETE FROM pending_creates WHERE di_id = $1")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE dedicated_inferences SET create_fingerprint = NULL, create_status_code = NULL, create_response = NULL
         WHERE id = $1 AND create_response IS NOT NULL",
    )
    .bind(id)
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM idempotency_keys WHERE target_di_id = $1 AND status_code IS NULL")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE idempotency_keys SET sealed_body = NULL, sealed_operation = NULL
         WHERE (di_id = $1 OR target_di_id = $1) AND (sealed_body IS NOT NULL OR sealed_operation IS NOT NULL)",
    )
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

//! Re-sealing every sealed value of the region under the current sealing key: the middle step of
//! a key rotation, run while the services serve (see [`Store::reseal`]).

use uuid::Uuid;

use crate::{ca_aad, secret_aad, Result, Store};

/// What a re-seal did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResealReport {
    /// Values rewritten under the current key.
    pub resealed: u64,
    /// The DIs with a value none of the configured keys opens: the old key must stay until they
    /// are dealt with.
    pub unreadable: Vec<Uuid>,
}

impl Store {
    /// Seals every stored secret (provider secrets, CA keys) again under the current key, `batch`
    /// rows at a time. Values already under it are skipped, so it can run again (and must, until
    /// it reports nothing unreadable) before the old key is removed from the configuration. Each
    /// value is replaced only if nobody changed it meanwhile, so services keep writing throughout.
    pub async fn reseal(&self, batch: i64) -> Result<ResealReport> {
        let prefix = self.sealer.current_prefix();
        let mut report = ResealReport::default();
        let mut after = (Uuid::nil(), String::new());
        loop {
            let rows: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(
                "SELECT di_id, kind, sealed FROM provider_secrets
                 WHERE (di_id, kind) > ($1, $2) AND substring(sealed from 1 for $3) <> $4
                 ORDER BY di_id, kind LIMIT $5",
            )
            .bind(after.0)
            .bind(&after.1)
            .bind(prefix.len() as i32)
            .bind(&prefix)
            .bind(batch)
            .fetch_all(&self.pool)
            .await?;
            let Some((id, kind, _)) = rows.last() else {
                break;
            };
            after = (*id, kind.clone());
            for (id, kind, sealed) in rows {
                let aad = secret_aad(id, &kind);
                if let Some(resealed) = self.resealed(&sealed, &aad, &mut report, id) {
                    sqlx::query(
                        "UPDATE provider_secrets SET sealed = $4 WHERE di_id = $1 AND kind = $2 AND sealed = $3",
                    )
                    .bind(id)
                    .bind(&kind)
                    .bind(&sealed)
                    .bind(&resealed)
                    .execute(&self.pool)
                    .await?;
                }
            }
        }
        let mut after = 0i64;
        loop {
            let rows: Vec<(i64, Uuid, Vec<u8>)> = sqlx::query_as(
                "SELECT id, di_id, key_sealed FROM certificate_authorities
                 WHERE id > $1 AND substring(key_sealed from 1 for $2) <> $3 ORDER BY id LIMIT $4",
            )
            .bind(after)
            .bind(prefix.len() as i32)
            .bind(&prefix)
            .bind(batch)
            .fetch_all(&self.pool)
            .await?;
            let Some((last, ..)) = rows.last() else {
                break;
            };
            after = *last;
            for (row, id, sealed) in rows {
                if let Some(resealed) = self.resealed(&sealed, &ca_aad(id), &mut report, id) {
                    sqlx::query(
                        "UPDATE certificate_authorities SET key_sealed = $3 WHERE id = $1 AND key_sealed = $2",
                    )
                    .bind(row)
                    .bind(&sealed)
                    .bind(&resealed)
                    .execute(&self.pool)
                    .await?;
                }
            }
        }
        Ok(report)
    }

    /// `sealed` under the current key, counted in `report`; `None` when there is nothing to write.
    fn resealed(
        &self,
        sealed: &[u8],
        aad: &str,
        report: &mut ResealReport,
        id: Uuid,
    ) -> Option<Vec<u8>> {
        match self.sealer.reseal(sealed, aad.as_bytes()) {
            Ok(Some(resealed)) => {
                report.resealed += 1;
                Some(resealed)
            }
            Ok(None) => None,
            Err(_) => {
                report.unreadable.push(id);
                None
            }
        }
    }
}

//! Each DI's certificate authorities. A DI gets one at create; before it expires the regional
//! service adds a successor ([`Store::certificate_authority_renew`]), and for the overlap the DI
//! has both: `GET …/ca` returns both, the workers sign with the one that fits (see the worker's
//! `plan::certificates`). An expired CA with a successor is deleted, key and all.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::{ca_aad, change, lock_live, Result, Store, StoreError};

/// A CA (PEM) and when the control plane stops using it; the key is sealed before storage.
#[derive(Debug, Clone)]
pub struct NewCa {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: DateTime<Utc>,
}

/// The DI's CAs still in use: those not expired, and the newest in any case (so that a DI whose
/// renewal has not run yet still has one).
pub(crate) const IN_USE: &str = "di_id = $1 AND (not_after > now()
     OR not_after = (SELECT max(not_after) FROM certificate_authorities WHERE di_id = $1))";

impl Store {
    pub(crate) async fn certificate_authority_insert(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
        ca: &NewCa,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO certificate_authorities (di_id, cert_pem, key_sealed, not_after) VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(&ca.cert_pem)
        .bind(
            self.sealer
                .seal(ca.key_pem.as_bytes(), ca_aad(id).as_bytes()),
        )
        .bind(ca.not_after)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// What `GET …/ca` returns: the certificates (PEM) of the DI's CAs in use, oldest first. Two
    /// while a renewal overlaps, so that a client trusting the bundle keeps working when the
    /// endpoints switch to the new CA.
    pub async fn ca_certificate(&self, id: Uuid, team_id: Uuid) -> Result<String> {
        self.ensure_visible(id, team_id).await?;
        let certs: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT cert_pem FROM certificate_authorities WHERE {IN_USE} ORDER BY not_after"
        ))
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        if certs.is_empty() {
            return Err(StoreError::NotFound);
        }
        Ok(certs.concat())
    }

    /// The DI's newest CA with its unsealed private key.
    pub async fn certificate_authority(&self, id: Uuid) -> Result<NewCa> {
        let mut conn = self.pool.acquire().await?;
        self.certificate_authorities_on(&mut conn, id)
            .await?
            .pop()
            .ok_or(StoreError::NotFound)
    }

    /// The DI's CAs in use with their unsealed keys, the one that expires first first: what a
    /// worker chooses the endpoints' issuer from.
    pub(crate) async fn certificate_authorities_on(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
    ) -> Result<Vec<NewCa>> {
        let rows: Vec<(String, Vec<u8>, DateTime<Utc>)> = sqlx::query_as(&format!(
            "SELECT cert_pem, key_sealed, not_after FROM certificate_authorities WHERE {IN_USE}
             ORDER BY not_after"
        ))
        .bind(id)
        .fetch_all(&mut *conn)
        .await?;
        rows.into_iter()
            .map(|(cert_pem, key_sealed, not_after)| {
                self.open_ca(id, cert_pem, &key_sealed, not_after)
            })
            .collect()
    }

    /// DI `id`'s CA, its key unsealed.
    pub(crate) fn open_ca(
        &self,
        id: Uuid,
        cert_pem: String,
        key_sealed: &[u8],
        not_after: DateTime<Utc>,
    ) -> Result<NewCa> {
        let key = self
            .sealer
            .open(key_sealed, ca_aad(id).as_bytes())
            .map_err(|_| StoreError::Seal)?;
        Ok(NewCa {
            cert_pem,
            key_pem: String::from_utf8(key).map_err(|_| StoreError::Seal)?,
            not_after,
        })
    }

    /// Up to `limit` live DIs (not being deleted) whose newest CA expires within `renew_before`.
    pub async fn certificate_authorities_due(
        &self,
        renew_before: Duration,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT d.id FROM dedicated_inferences d
             WHERE d.gone_at IS NULL AND d.status <> 'deleting'
               AND (SELECT max(not_after) FROM certificate_authorities c WHERE c.di_id = d.id)
                   < now() + make_interval(secs => $1)
             ORDER BY d.id LIMIT $2",
        )
        .bind(renew_before.as_secs_f64())
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Adds `ca` as DI `id`'s successor CA, with an event telling the customer to fetch the CA
    /// bundle, if the DI's newest CA still expires within `renew_before` (false otherwise: a
    /// concurrent renewal came first, or the DI is being deleted). `NotFound` once gone.
    pub async fn certificate_authority_renew(
        &self,
        id: Uuid,
        ca: &NewCa,
        renew_before: Duration,
    ) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        if !row.status.accepts_changes() {
            return Ok(false);
        }
        let newest: Option<(DateTime<Utc>, bool)> = sqlx::query_as(
            "SELECT not_after, not_after < now() + make_interval(secs => $2) FROM certificate_authorities
             WHERE di_id = $1 ORDER BY not_after DESC LIMIT 1",
        )
        .bind(id)
        .bind(renew_before.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((expires, true)) = newest else {
            return Ok(false);
        };
        self.certificate_authority_insert(&mut tx, id, ca).await?;
        let message = format!(
            "A new certificate authority, valid until {}, was made. GET …/ca returns it with the \
             current one, which expires on {}: trust both. The endpoints switch to the new one \
             before the current one expires.",
            ca.not_after.format("%Y-%m-%d"),
            expires.format("%Y-%m-%d"),
        );
        change(
            &mut tx,
            id,
            row.status,
            "CertificateAuthorityRenewed",
            &message,
            false,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Deletes every expired CA that has a successor (its key with it); returns how many.
    pub async fn certificate_authorities_retire(&self) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM certificate_authorities c WHERE c.not_after < now()
               AND EXISTS (SELECT 1 FROM certificate_authorities n WHERE n.di_id = c.di_id AND n.not_after > c.not_after)",
        )
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}

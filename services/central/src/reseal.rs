//! `central reseal`: seals everything central keeps sealed (pending creates' intents, replayable
//! responses, keyed operations) again under the current key, the middle step of a key rotation.
//! It runs beside the serving replicas: each value is replaced only if nobody changed it
//! meanwhile, and values already under the current key are skipped, so it can run again.

use central_store::{CentralStore, SealedAt};
use common::seal::Sealer;

/// What a re-seal did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResealReport {
    /// Values rewritten under the current key.
    pub resealed: u64,
    /// Where the values are that no configured key opens: the old key must stay until they are
    /// dealt with (or purged, within a day).
    pub unreadable: Vec<SealedAt>,
}

pub async fn reseal(
    store: &CentralStore,
    sealer: &Sealer,
    batch: i64,
) -> anyhow::Result<ResealReport> {
    let prefix = sealer.current_prefix();
    let mut report = ResealReport::default();
    for mut after in SealedAt::starts() {
        loop {
            let values = store.sealed_values_after(&after, &prefix, batch).await?;
            let Some(last) = values.last() else {
                break;
            };
            after = last.at.clone();
            for value in values {
                let aad = crate::app::sealed_aad(&value.at);
                match sealer.reseal(&value.sealed, aad.as_bytes()) {
                    Ok(Some(resealed)) => {
                        if store.sealed_value_replace(&value, &resealed).await? {
                            report.resealed += 1;
                        }
                    }
                    Ok(None) => {}
                    Err(_) => report.unreadable.push(value.at),
                }
            }
        }
    }
    Ok(report)
}

//! `endpoint-auth`: the bearer-token check of one DI's endpoint, as an Envoy HTTP external
//! authorization service. Envoy Gateway's `SecurityPolicy` (`extAuth.http`) sends every client
//! request's method, `Authorization` header (and Host, Path, Content-Length) to `/check` +
//! the original path; this service answers 200 with an empty body to let the request through,
//! or [`refusal`] (401, `WWW-Authenticate: Bearer`, OpenAI's error shape), which Envoy relays to
//! the client as is. It owns that protocol, the reading of the DI's access-token Secret (an
//! Opaque Secret the worker writes in the DI's namespace: one key per token id, the value the
//! lowercase hex SHA-256 of the token), and the rule that it fails closed: until the Secret has
//! been read, or once it is deleted, every request is refused. Only hashes are ever held; a
//! token's text is hashed on arrival and appears in no log, error or trace.
//!
//! [`HashSource::watch_secret`] keeps the hashes current with a kube-rs watcher on that one
//! Secret (field selector `metadata.name=<name>`, so a Role granting get/list/watch on that
//! `resourceName` suffices); a revoked token is refused from the watch event that drops its
//! hash. If the API server cannot be reached, the hashes last read stay in force while the
//! watcher retries.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// The hashes the service checks against (hex SHA-256, lowercase).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenHashes(HashSet<String>);

impl TokenHashes {
    /// From hex SHA-256 values, in any case and with surrounding whitespace. A value that is not
    /// 64 hex digits could never match a token's hash, and is left out.
    pub fn from_hex<I, S>(hex: I) -> TokenHashes
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        TokenHashes(
            hex.into_iter()
                .filter_map(|h| normalise(h.as_ref()))
                .collect(),
        )
    }

    /// From a Secret as Kubernetes serves it (`data` base64, `stringData` never served but
    /// accepted too). The keys (token ids) are not looked at.
    pub fn from_secret(secret: &Secret) -> TokenHashes {
        let data = secret
            .data
            .iter()
            .flatten()
            .map(|(_, v)| std::str::from_utf8(&v.0).unwrap_or(""));
        let string_data = secret.string_data.iter().flatten().map(|(_, v)| v.as_str());
        let values: Vec<&str> = data.chain(string_data).collect();
        let hashes = TokenHashes::from_hex(&values);
        let ignored = values.len() - hashes.len();
        if ignored > 0 {
            // Duplicates count here too; neither case says anything about a token.
            tracing::warn!(
                ignored,
                "values of the access-token Secret that are no SHA-256 hex (or repeat one) were left out"
            );
        }
        hashes
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn contains(&self, digest: &str) -> bool {
        self.0.contains(digest)
    }
}

/// `value` trimmed and lowercased if it is a SHA-256 in hex.
fn normalise(value: &str) -> Option<String> {
    let hex = value.trim().to_ascii_lowercase();
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hex)
}

/// The answer to one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Refuse,
}

/// The token of a `Bearer` credential (RFC 6750; the scheme is case-insensitive), trimmed;
/// `None` for another scheme or an empty token (the value is trimmed first, so a scheme with
/// nothing but whitespace after it has no separator left).
fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once([' ', '\t'])?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim_start())
}

/// The lowercase hex SHA-256 of the bearer token in `authorization`, if it holds one.
fn token_digest(authorization: Option<&str>) -> Option<String> {
    let token = bearer_token(authorization?)?;
    Some(hex::encode(Sha256::digest(token.as_bytes())))
}

fn decide_digest(digest: Option<&str>, hashes: Option<&TokenHashes>) -> Decision {
    match (digest, hashes) {
        (Some(digest), Some(hashes)) if hashes.contains(digest) => Decision::Allow,
        _ => Decision::Refuse,
    }
}

/// `authorization`: the check request's Authorization header, if any. `hashes`: None while the
/// Secret has not been read (or does not exist): fail closed.
pub fn decide(authorization: Option<&str>, hashes: Option<&TokenHashes>) -> Decision {
    decide_digest(token_digest(authorization).as_deref(), hashes)
}

/// The body of [`refusal`], byte for byte what OpenAI's API answers a bad key with.
const REFUSAL_BODY: &str = r#"{"error":{"message":"Invalid or missing access token.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#;

/// The HTTP answer Envoy relays to the client on Refuse: 401, `WWW-Authenticate: Bearer`,
/// content-type application/json, body in OpenAI's error shape.
pub fn refusal() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [
            (header::WWW_AUTHENTICATE, "Bearer"),
            (header::CONTENT_TYPE, "application/json"),
        ],
        REFUSAL_BODY,
    )
        .into_response()
}

#[derive(Debug, Default)]
struct Hashes {
    current: Option<TokenHashes>,
}

/// Where the service gets its hashes: a cheap-clone handle on the current value, either set
/// by hand ([`HashSource::fixed`], [`HashSource::set`]) or fed by Kubernetes
/// ([`HashSource::watch_secret`]). Every clone sees the same value.
#[derive(Debug, Clone)]
pub struct HashSource {
    hashes: Arc<watch::Sender<Hashes>>,
}

impl HashSource {
    /// A source holding `hashes` until [`HashSource::set`] replaces them (tests, the simulator).
    pub fn fixed(hashes: Option<TokenHashes>) -> HashSource {
        let source = HashSource {
            hashes: Arc::new(watch::Sender::new(Hashes::default())),
        };
        source.set(hashes);
        source
    }

    /// Replaces the hashes; `None` refuses every request from now on.
    pub fn set(&self, hashes: Option<TokenHashes>) {
        self.hashes.send_modify(|h| h.current = hashes);
    }

    /// The hashes in force (a copy).
    pub fn current(&self) -> Option<TokenHashes> {
        self.hashes.borrow().current.clone()
    }

    /// Whether there are hashes to check against (`/readyz`): not before the Secret has been
    /// read, nor once it is deleted. An unready replica gets no checks from Envoy, which then
    /// answers the policy's `statusOnError` (503, retried by clients) rather than this
    /// service's 401 (which tells a client its key is bad).
    pub fn is_ready(&self) -> bool {
        self.hashes.borrow().current.is_some()
    }

    /// [`decide`] against the hashes in force.
    pub fn decide(&self, authorization: Option<&str>) -> Decision {
        // Hashed before the lock is taken, so a check holds it only for a set lookup.
        let digest = token_digest(authorization);
        decide_digest(digest.as_deref(), self.hashes.borrow().current.as_ref())
    }

    /// A source fed from the Secret `name` of `namespace`, and the future that feeds it (spawn
    /// it; it runs until dropped). Until the watcher's first list has found the Secret the
    /// source holds `None`; a deleted Secret turns it back to `None`. Watch errors are logged
    /// and retried with kube's backoff, re-listing as kube's watcher does, and the hashes last
    /// read stay in force meanwhile.
    pub fn watch_secret(
        client: kube::Client,
        namespace: &str,
        name: &str,
    ) -> (HashSource, impl Future<Output = ()> + Send + 'static) {
        let source = HashSource::fixed(None);
        let api: Api<Secret> = Api::namespaced(client, namespace);
        let feed = feed(api, namespace.to_string(), name.to_string(), source.clone());
        (source, feed)
    }
}

async fn feed(api: Api<Secret>, namespace: String, name: String, source: HashSource) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    // What the list in progress found; replaces the hashes only once the list is complete.
    let mut listed: Option<TokenHashes> = None;
    let named = |secret: &Secret| secret.metadata.name.as_deref() == Some(name.as_str());
    while let Some(event) = events.next().await {
        let update = match event {
            Ok(Event::Init) => {
                listed = None;
                continue;
            }
            Ok(Event::InitApply(secret)) => {
                if named(&secret) {
                    listed = Some(TokenHashes::from_secret(&secret));
                }
                continue;
            }
            Ok(Event::InitDone) => listed.take(),
            Ok(Event::Apply(secret)) if named(&secret) => Some(TokenHashes::from_secret(&secret)),
            Ok(Event::Delete(secret)) if named(&secret) => None,
            Ok(Event::Apply(_) | Event::Delete(_)) => continue,
            Err(error) => {
                tracing::warn!(%error, %namespace, secret = %name,
                    "watching the access-token Secret failed; retrying, the hashes last read stay in force");
                continue;
            }
        };
        match &update {
            Some(hashes) => {
                tracing::info!(%namespace, secret = %name, tokens = hashes.len(), "token hashes read")
            }
            None => tracing::warn!(%namespace, secret = %name,
                "the access-token Secret does not exist: refusing every request"),
        }
        source.set(update);
    }
}

/// The service's router: any method on any path under `/check` (Envoy sends the original method
/// and `path` prefix + original path) → 200 empty body on Allow, [`refusal`] on Refuse;
/// 503 while there are no hashes; `GET /healthz` → 200; `GET /readyz` → 200 while there are
/// hashes, else 503.
pub fn router(hashes: HashSource) -> Router {
    Router::new()
        .route("/check", any(check))
        .route("/check/", any(check))
        .route("/check/{*path}", any(check))
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route("/readyz", get(readyz))
        .with_state(hashes)
}

async fn check(State(hashes): State<HashSource>, headers: HeaderMap) -> Response {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    // Two credentials are ambiguous: refused, like one that is not text.
    let authorization = match (values.next(), values.next()) {
        (Some(value), None) => value.to_str().ok(),
        _ => None,
    };
    if !hashes.is_ready() {
        // Nothing to check against: not the client's fault, so not a 401 (see `is_ready`).
        tracing::debug!("no hashes to check against");
        return unavailable();
    }
    let decision = hashes.decide(authorization);
    tracing::debug!(?decision, "checked");
    match decision {
        Decision::Allow => StatusCode::OK.into_response(),
        Decision::Refuse => refusal(),
    }
}

/// The answer while there are no hashes: 503 with `Retry-After`, in OpenAI's error shape.
fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "5"), (header::CONTENT_TYPE, "application/json")],
        r#"{"error":{"message":"The endpoint's access check is not ready; retry shortly.","type":"server_error","param":null,"code":503}}"#,
    )
        .into_response()
}

async fn readyz(State(hashes): State<HashSource>) -> StatusCode {
    if hashes.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    use super::*;

    const GOOD: &str = "di_0123456789abcdefghijABCDEFGHIJ0123456789xyzXYZ";
    const OTHER: &str = "di_ZYXzyx9876543210JIHGFEDCBAjihgfedcba9876543210";

    fn sha(token: &str) -> String {
        hex::encode(Sha256::digest(token.as_bytes()))
    }

    fn hashes(tokens: &[&str]) -> TokenHashes {
        TokenHashes::from_hex(tokens.iter().map(|t| sha(t)))
    }

    fn bearer(token: &str) -> String {
        format!("Bearer {token}")
    }

    #[test]
    fn a_known_token_is_allowed() {
        let h = hashes(&[GOOD, OTHER]);
        assert_eq!(decide(Some(&bearer(GOOD)), Some(&h)), Decision::Allow);
        assert_eq!(decide(Some(&bearer(OTHER)), Some(&h)), Decision::Allow);
    }

    #[test]
    fn a_wrong_token_is_refused() {
        let h = hashes(&[GOOD]);
        assert_eq!(decide(Some(&bearer(OTHER)), Some(&h)), Decision::Refuse);
        // Its hash is not a token either.
        assert_eq!(
            decide(Some(&bearer(&sha(GOOD))), Some(&h)),
            Decision::Refuse
        );
    }

    #[test]
    fn no_header_is_refused() {
        assert_eq!(decide(None, Some(&hashes(&[GOOD]))), Decision::Refuse);
    }

    #[test]
    fn another_scheme_is_refused() {
        let h = hashes(&[GOOD]);
        assert_eq!(
            decide(Some(&format!("Basic {GOOD}")), Some(&h)),
            Decision::Refuse
        );
        // The bare token, without a scheme.
        assert_eq!(decide(Some(GOOD), Some(&h)), Decision::Refuse);
        assert_eq!(
            decide(Some(&format!("Bearer{GOOD}")), Some(&h)),
            Decision::Refuse
        );
    }

    #[test]
    fn an_empty_bearer_is_refused_even_if_the_empty_string_is_listed() {
        let h = hashes(&[GOOD, ""]);
        for value in ["Bearer", "Bearer ", "Bearer    ", "bearer \t", ""] {
            assert_eq!(decide(Some(value), Some(&h)), Decision::Refuse, "{value:?}");
        }
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_trimmed() {
        let h = hashes(&[GOOD]);
        for value in [
            format!("bearer {GOOD}"),
            format!("BEARER {GOOD}"),
            format!("Bearer   {GOOD}  "),
            format!("Bearer\t{GOOD}"),
        ] {
            assert_eq!(decide(Some(&value), Some(&h)), Decision::Allow, "{value:?}");
        }
        // The token itself is case-sensitive.
        let upper = GOOD.to_ascii_uppercase();
        assert_eq!(decide(Some(&bearer(&upper)), Some(&h)), Decision::Refuse);
    }

    #[test]
    fn no_hashes_refuse_everything() {
        assert_eq!(decide(Some(&bearer(GOOD)), None), Decision::Refuse);
        let empty = TokenHashes::default();
        assert!(empty.is_empty());
        assert_eq!(decide(Some(&bearer(GOOD)), Some(&empty)), Decision::Refuse);
    }

    #[test]
    fn a_revoked_token_is_refused() {
        let source = HashSource::fixed(Some(hashes(&[GOOD, OTHER])));
        assert_eq!(source.decide(Some(&bearer(GOOD))), Decision::Allow);
        source.set(Some(hashes(&[OTHER])));
        assert_eq!(source.decide(Some(&bearer(GOOD))), Decision::Refuse);
        assert_eq!(source.decide(Some(&bearer(OTHER))), Decision::Allow);
        source.set(None);
        assert_eq!(source.decide(Some(&bearer(OTHER))), Decision::Refuse);
        assert!(!source.is_ready(), "nothing to check against: not ready");
    }

    fn secret(data: &[(&str, &str)], string_data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            string_data: Some(
                string_data
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn hashes_in_the_secret_are_trimmed_and_lowercased() {
        let messy = format!("  {}\n", sha(GOOD).to_ascii_uppercase());
        let s = secret(
            &[("3f1c0e6a-0000-4000-8000-000000000001", &messy)],
            &[(
                "3f1c0e6a-0000-4000-8000-000000000002",
                &format!("\t{}", sha(OTHER)),
            )],
        );
        let h = TokenHashes::from_secret(&s);
        assert_eq!(h, hashes(&[GOOD, OTHER]));
        assert_eq!(h.len(), 2);
        assert_eq!(decide(Some(&bearer(GOOD)), Some(&h)), Decision::Allow);
        assert_eq!(decide(Some(&bearer(OTHER)), Some(&h)), Decision::Allow);
    }

    #[test]
    fn what_is_no_sha256_is_left_out() {
        let h = TokenHashes::from_hex(["", "  ", "not-hex", &sha(GOOD)[..63], &sha(GOOD)]);
        assert_eq!(h.len(), 1);
        // A value the worker never writes (a token's text) does not make that token valid.
        let s = secret(&[("a", GOOD)], &[]);
        assert!(TokenHashes::from_secret(&s).is_empty());
        assert!(TokenHashes::from_secret(&Secret::default()).is_empty());
    }

    #[test]
    fn readiness_follows_the_first_hashes() {
        let source = HashSource::fixed(None);
        assert!(!source.is_ready());
        source.set(None);
        assert!(!source.is_ready());
        source.set(Some(TokenHashes::default()));
        assert!(source.is_ready());
        assert_eq!(source.current(), Some(TokenHashes::default()));
    }

    #[test]
    fn the_refusal_is_openai_shaped() {
        let body: serde_json::Value = serde_json::from_str(REFUSAL_BODY).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {
                "message": "Invalid or missing access token.",
                "type": "invalid_request_error",
                "param": null,
                "code": "invalid_api_key",
            }})
        );
        let r = refusal();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
    }
}

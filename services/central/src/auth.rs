//! Bearer-token authentication and per-token rate limiting.
//!
//! API tokens are stored hashed in central's database and map to a team and a set of scopes.
//! Lookups are cached briefly (`auth_cache_ttl`) so that a hot GET costs one query, not two; a
//! revoked token therefore stops working within that TTL. Rate limits are per token, counted in
//! this process over fixed one-hour windows, and reported with DigitalOcean's `ratelimit-*` headers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use central_store::ApiToken;
use uuid::Uuid;

use crate::error::ApiError;
use crate::App;

pub const SCOPES: &[&str] = &[
    "dedicated_inference:read",
    "dedicated_inference:create",
    "dedicated_inference:update",
    "dedicated_inference:delete",
    "dedicated_inference_tokens:read",
    "dedicated_inference_tokens:create",
    "dedicated_inference_tokens:delete",
];

/// Who is calling: set on the request by the middleware, read by handlers.
#[derive(Debug, Clone)]
pub struct Principal {
    pub token_id: Uuid,
    pub team_id: Uuid,
    /// Shared with the token cache: no per-request copy of the scope list.
    scopes: Arc<[String]>,
}

impl Principal {
    /// `dedicated_inference_token:*` is accepted as a spelling of `dedicated_inference_tokens:*`.
    pub fn require(&self, scope: &str) -> Result<(), ApiError> {
        let (resource, _) = scope.split_once(':').unwrap_or((scope, ""));
        let singular = scope.strip_prefix("dedicated_inference_tokens:");
        let granted = self.scopes.iter().any(|s| {
            s == scope
                || s == "*"
                || s.strip_suffix(":*") == Some(resource)
                || (singular.is_some() && s.strip_prefix("dedicated_inference_token:") == singular)
        });
        if granted {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "This token lacks the {scope} scope."
            )))
        }
    }
}

pub struct Authenticator {
    ttl: Duration,
    default_limit: u32,
    cache: Mutex<HashMap<[u8; 32], (Option<Grant>, Instant)>>,
    windows: Mutex<HashMap<Uuid, Window>>,
}

/// A cached token: its scopes shared with every request that presents it.
#[derive(Clone)]
struct Grant {
    token: ApiToken,
    scopes: Arc<[String]>,
}

struct Window {
    hour: u64,
    used: u32,
}

const WINDOW_SECS: u64 = 3600;
const CACHE_CAP: usize = 100_000;

impl Authenticator {
    pub fn new(ttl: Duration, default_limit: u32) -> Authenticator {
        Authenticator {
            ttl,
            default_limit,
            cache: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
        }
    }

    async fn token(&self, app: &App, hash: [u8; 32]) -> Result<Option<Grant>, ApiError> {
        if let Some((token, at)) = self.cache.lock().unwrap().get(&hash) {
            if at.elapsed() < self.ttl {
                return Ok(token.clone());
            }
        }
        let token = app
            .store
            .api_token_by_hash(&hash)
            .await?
            .map(|mut token| Grant {
                // Moved out, so that cloning the grant copies no strings.
                scopes: std::mem::take(&mut token.scopes).into(),
                token,
            });
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= CACHE_CAP {
            cache.clear();
        }
        cache.insert(hash, (token.clone(), Instant::now()));
        Ok(token)
    }

    /// Counts one request against the token's window: (limit, remaining, reset epoch, allowed).
    fn count(&self, token: &ApiToken) -> (u32, u32, u64, bool) {
        let limit = token
            .rate_limit_per_hour
            .map(|l| l.max(0) as u32)
            .unwrap_or(self.default_limit);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let hour = now / WINDOW_SECS;
        let reset = (hour + 1) * WINDOW_SECS;
        let mut windows = self.windows.lock().unwrap();
        let window = windows.entry(token.id).or_insert(Window { hour, used: 0 });
        if window.hour != hour {
            *window = Window { hour, used: 0 };
        }
        if window.used >= limit {
            return (limit, 0, reset, false);
        }
        window.used += 1;
        (limit, limit - window.used, reset, true)
    }
}

/// Authenticates, rate-limits and adds the `ratelimit-*` headers to every response.
pub async fn layer(State(app): State<App>, mut req: Request, next: Next) -> Response {
    let auth = &app.auth;
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|t| !t.is_empty() && t.len() <= 256);
    let token = match presented {
        None => None,
        Some(value) => match auth.token(&app, common::tokens::sha256(value)).await {
            Ok(grant) => grant.filter(|g| !g.token.revoked),
            Err(e) => return e.into_response(),
        },
    };
    let Some(Grant { token, scopes }) = token else {
        let mut response = ApiError::Unauthorized.into_response();
        headers(
            &mut response,
            auth.default_limit,
            auth.default_limit,
            next_reset(),
        );
        return response;
    };
    let (limit, remaining, reset, allowed) = auth.count(&token);
    let mut response = if allowed {
        req.extensions_mut().insert(Principal {
            token_id: token.id,
            team_id: token.team_id,
            scopes,
        });
        next.run(req).await
    } else {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        ApiError::TooManyRequests {
            retry_after_secs: reset.saturating_sub(now).max(1),
        }
        .into_response()
    };
    headers(&mut response, limit, remaining, reset);
    response
}

fn next_reset() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    (now / WINDOW_SECS + 1) * WINDOW_SECS
}

fn headers(response: &mut Response, limit: u32, remaining: u32, reset: u64) {
    let h = response.headers_mut();
    h.insert("ratelimit-limit", HeaderValue::from(limit));
    h.insert("ratelimit-remaining", HeaderValue::from(remaining));
    h.insert("ratelimit-reset", HeaderValue::from(reset));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(scopes: &[&str]) -> Principal {
        Principal {
            token_id: Uuid::nil(),
            team_id: Uuid::nil(),
            scopes: scopes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    #[test]
    fn scopes_match_exactly_or_by_the_singular_spelling() {
        let p = principal(&[
            "dedicated_inference:read",
            "dedicated_inference_token:create",
        ]);
        assert!(p.require("dedicated_inference:read").is_ok());
        assert!(p.require("dedicated_inference:create").is_err());
        assert!(p.require("dedicated_inference_tokens:create").is_ok());
        assert!(p.require("dedicated_inference_tokens:delete").is_err());
        // A resource wildcard covers that resource only; `*` covers everything.
        let p = principal(&["dedicated_inference:*"]);
        assert!(p.require("dedicated_inference:delete").is_ok());
        assert!(p.require("dedicated_inference_tokens:read").is_err());
        assert!(principal(&["*"])
            .require("dedicated_inference_tokens:delete")
            .is_ok());
    }

    #[test]
    fn the_window_runs_out_and_reports_remaining() {
        let auth = Authenticator::new(Duration::from_secs(1), 2);
        let token = ApiToken {
            id: Uuid::new_v4(),
            team_id: Uuid::nil(),
            scopes: vec![],
            rate_limit_per_hour: None,
            revoked: false,
        };
        assert_eq!(auth.count(&token).1, 1);
        assert_eq!(auth.count(&token).1, 0);
        let (_, remaining, _, allowed) = auth.count(&token);
        assert!(!allowed);
        assert_eq!(remaining, 0);
    }
}

//! Bearer-token authentication, a budget of failed authentications per client address, and
//! per-token rate limiting.
//!
//! API tokens are stored hashed in central's database and map to a team and a set of scopes. A
//! presented value is looked up only if it can be a token: the current format with a valid
//! checksum ([`common::tokens`]), or exactly the shape of the tokens minted before it. Anything
//! else is refused without a query. Tokens found (revoked ones too) are cached for
//! `auth_cache_ttl`, so that a hot GET costs one query, not two; the TTL is at most
//! [`MAX_AUTH_CACHE_TTL`], so a revoked token stops working within 5 s on every replica. Only
//! tokens that exist are cached: values nobody was given cannot push real ones out.
//!
//! Failed authentications are budgeted per client address ([`FailureBudget`]): beyond the
//! budget they are answered 429, and a value this process has never seen is not looked up at
//! all. Successes cost nothing, and tokens this process knows keep working from an address over
//! its budget, so customers who share an address with an attacker (one NAT) keep working with
//! the tokens they use; a token new to this replica waits for the budget (`Retry-After`).
//!
//! Rate limits are per token, counted in this process over fixed one-hour windows, and reported
//! with DigitalOcean's `ratelimit-*` headers.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use central_store::ApiToken;
use common::tokens;
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

/// How stale a cached token may be: a revoked token must be refused within 5 s everywhere, and
/// each replica caches on its own.
pub const MAX_AUTH_CACHE_TTL: Duration = Duration::from_secs(5);

pub struct Authenticator {
    /// What API tokens are minted and recognised with: a value it did not mint is refused
    /// without a lookup.
    key: tokens::ApiTokenKey,
    ttl: Duration,
    default_limit: u32,
    /// Lookups of legacy (unkeyed) tokens this replica has not seen, for all clients together:
    /// what a flood of made-up values of that shape can cost the database, however many
    /// addresses it comes from.
    legacy_lookups: Mutex<Bucket>,
    /// Tokens that exist (revoked ones included) by hash, with when they were read.
    cache: Mutex<HashMap<[u8; 32], Cached>>,
    failures: Mutex<FailureBudget>,
    /// Where the client's address comes from when a proxy stands in front (`CLIENT_IP_HEADER`).
    client_ip_header: Option<HeaderName>,
    windows: Mutex<HashMap<Uuid, Window>>,
}

/// A cached token: its scopes shared with every request that presents it.
#[derive(Clone)]
struct Grant {
    token: ApiToken,
    scopes: Arc<[String]>,
}

struct Cached {
    grant: Grant,
    read_at: Instant,
}

struct Window {
    hour: u64,
    used: u32,
}

const WINDOW_SECS: u64 = 3600;
/// Only real tokens are cached, so reaching this means many tokens in use on one replica.
const CACHE_CAP: usize = 100_000;
/// A cached token not read for this long may make room for another.
const CACHE_IDLE: Duration = Duration::from_secs(3600);

impl Authenticator {
    pub fn new(
        key: tokens::ApiTokenKey,
        ttl: Duration,
        default_limit: u32,
        failures_per_minute: u32,
        client_ip_header: Option<&str>,
    ) -> anyhow::Result<Authenticator> {
        anyhow::ensure!(
            ttl <= MAX_AUTH_CACHE_TTL,
            "AUTH_CACHE_TTL_MS is at most {} ms: a revoked token must be refused within that",
            MAX_AUTH_CACHE_TTL.as_millis()
        );
        anyhow::ensure!(
            failures_per_minute > 0,
            "AUTH_FAILURES_PER_MINUTE must be at least 1"
        );
        let client_ip_header = client_ip_header
            .filter(|h| !h.trim().is_empty())
            .map(|h| HeaderName::try_from(h.trim()))
            .transpose()
            .map_err(|e| anyhow::anyhow!("CLIENT_IP_HEADER: {e}"))?;
        Ok(Authenticator {
            key,
            ttl,
            default_limit,
            legacy_lookups: Mutex::new(Bucket {
                left: LEGACY_LOOKUP_BURST,
                at: Instant::now(),
            }),
            cache: Mutex::new(HashMap::new()),
            failures: Mutex::new(FailureBudget::new(failures_per_minute)),
            client_ip_header,
            windows: Mutex::new(HashMap::new()),
        })
    }

    /// A new API token value, minted with this replica's key (for operators' tools and tests:
    /// the value is shown once and stored as its hash).
    pub fn mint(&self) -> String {
        self.key.mint()
    }

    /// The token `value` stands for, or why the request is refused.
    async fn authenticate(
        &self,
        app: &App,
        value: &str,
        client: IpAddr,
    ) -> Result<Grant, ApiError> {
        let now = Instant::now();
        let minted = self.key.minted(value);
        if !(minted || tokens::legacy_api_token_shape(value)) {
            return Err(self.failed(client, now));
        }
        let hash = tokens::sha256(value);
        let cached = self.cache.lock().unwrap().get(&hash).map(|c| {
            (
                c.grant.clone(),
                now.saturating_duration_since(c.read_at) < self.ttl,
            )
        });
        let grant = match cached {
            Some((grant, true)) => Some(grant),
            // A token that exists: reading it again is what the TTL costs, budget or not.
            Some((_, false)) => self.lookup(app, hash).await?,
            // Minted by central: a real token, unless revoked or deleted since. Looked up
            // without a charge, so customers sharing an address with an attacker keep working
            // with tokens this replica has not seen yet.
            None if minted => self.lookup(app, hash).await?,
            None => {
                // A legacy value never seen here, so perhaps made up: within the replica's
                // budget for those, and charged to the client before the lookup (refunded if it
                // is a token, so that concurrent forgeries cannot overrun the budget).
                if let Err(retry_after) = self.legacy_lookups.lock().unwrap().take(now) {
                    return Err(too_many_failures(retry_after));
                }
                let charge = self.failures.lock().unwrap().charge(client, now);
                if let Err(retry_after) = charge {
                    return Err(too_many_failures(retry_after));
                }
                let found = self.lookup(app, hash).await;
                return match found {
                    Ok(Some(grant)) if !grant.token.revoked => {
                        self.failures.lock().unwrap().refund(client);
                        Ok(grant)
                    }
                    Ok(_) => Err(ApiError::Unauthorized),
                    Err(e) => {
                        self.failures.lock().unwrap().refund(client);
                        Err(e)
                    }
                };
            }
        };
        match grant {
            Some(grant) if !grant.token.revoked => Ok(grant),
            _ => Err(self.failed(client, now)),
        }
    }

    /// Reads the token with this hash and caches it if it exists.
    async fn lookup(&self, app: &App, hash: [u8; 32]) -> Result<Option<Grant>, ApiError> {
        let grant = app
            .store
            .api_token_by_hash(&hash)
            .await?
            .map(|mut token| Grant {
                // Moved out, so that cloning the grant copies no strings.
                scopes: std::mem::take(&mut token.scopes).into(),
                token,
            });
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap();
        match &grant {
            None => {
                cache.remove(&hash);
            }
            Some(grant) => {
                if cache.len() >= CACHE_CAP && !cache.contains_key(&hash) {
                    cache.retain(|_, c| now.saturating_duration_since(c.read_at) < CACHE_IDLE);
                }
                // Still full: this one is read every time instead (and charged while new).
                if cache.len() < CACHE_CAP || cache.contains_key(&hash) {
                    let grant = grant.clone();
                    cache.insert(
                        hash,
                        Cached {
                            grant,
                            read_at: now,
                        },
                    );
                }
            }
        }
        Ok(grant)
    }

    /// Charges a failed authentication to `client`: 401 within the budget, 429 beyond it.
    fn failed(&self, client: IpAddr, now: Instant) -> ApiError {
        match self.failures.lock().unwrap().charge(client, now) {
            Ok(()) => ApiError::Unauthorized,
            Err(retry_after) => too_many_failures(retry_after),
        }
    }

    /// The client's address: the TCP peer, or the last address in `CLIENT_IP_HEADER` (the one
    /// the proxy in front of central appended) when that is configured and present.
    fn client(&self, req: &Request) -> IpAddr {
        let forwarded = self
            .client_ip_header
            .as_ref()
            // The last field of the header: the one the proxy in front of central wrote (a
            // client may send the header itself, and a proxy may add a field of its own
            // rather than append to the client's).
            .and_then(|h| req.headers().get_all(h).iter().next_back())
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .and_then(|v| v.trim().parse::<IpAddr>().ok());
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        forwarded
            .or(peer)
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
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
        .filter(|t| !t.is_empty());
    let grant = match presented {
        // Nothing presented: nothing to look up, no guess to budget.
        None => Err(ApiError::Unauthorized),
        Some(value) => auth.authenticate(&app, value, auth.client(&req)).await,
    };
    let Grant { token, scopes } = match grant {
        Ok(grant) => grant,
        Err(error) => {
            let mut response = error.into_response();
            headers(
                &mut response,
                auth.default_limit,
                auth.default_limit,
                next_reset(),
            );
            return response;
        }
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

fn too_many_failures(retry_after: Duration) -> ApiError {
    ApiError::TooManyFailedAuthentications {
        retry_after_secs: retry_after.as_secs_f64().ceil().max(1.0) as u64,
    }
}

/// Failed authentications per client address, as a token bucket: `per_minute` may fail at
/// once, and the budget refills evenly over a minute. An IPv6 client counts per /64 (what one
/// customer's host or network commonly holds), an IPv4 client per address.
struct FailureBudget {
    per_minute: u32,
    buckets: HashMap<IpAddr, Bucket>,
}

struct Bucket {
    left: f64,
    at: Instant,
}

/// Lookups a second of legacy tokens a replica has not seen, for all clients together, and how
/// many may come at once. Customers' legacy tokens are read once, then cached.
const LEGACY_LOOKUPS_PER_SECOND: f64 = 20.0;
const LEGACY_LOOKUP_BURST: f64 = 100.0;

impl Bucket {
    /// Takes one lookup, or says how long until there is one.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let refilled = self.left
            + LEGACY_LOOKUPS_PER_SECOND * now.saturating_duration_since(self.at).as_secs_f64();
        self.left = refilled.min(LEGACY_LOOKUP_BURST);
        self.at = self.at.max(now);
        if self.left >= 1.0 {
            self.left -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - self.left) / LEGACY_LOOKUPS_PER_SECOND,
            ))
        }
    }
}

/// Addresses followed at once. Beyond it, those whose budget is whole again are forgotten (they
/// are no different from new ones), then, if that is not enough, all of them: an attacker with
/// this many addresses gets fresh budgets rather than central's memory.
const BUDGET_ADDRESSES: usize = 100_000;

impl FailureBudget {
    fn new(per_minute: u32) -> FailureBudget {
        FailureBudget {
            per_minute,
            buckets: HashMap::new(),
        }
    }

    fn per_second(&self) -> f64 {
        f64::from(self.per_minute) / 60.0
    }

    /// Takes one failure from `client`'s budget, or says how long until there is one.
    fn charge(&mut self, client: IpAddr, now: Instant) -> Result<(), Duration> {
        let client = budget_key(client);
        let (full, rate) = (f64::from(self.per_minute), self.per_second());
        let refilled = |b: &Bucket| {
            (b.left + rate * now.saturating_duration_since(b.at).as_secs_f64()).min(full)
        };
        if self.buckets.len() >= BUDGET_ADDRESSES && !self.buckets.contains_key(&client) {
            self.buckets.retain(|_, b| refilled(b) < full);
            if self.buckets.len() >= BUDGET_ADDRESSES {
                self.buckets.clear();
            }
        }
        let bucket = self.buckets.entry(client).or_insert(Bucket {
            left: full,
            at: now,
        });
        bucket.left = refilled(bucket);
        bucket.at = bucket.at.max(now);
        if bucket.left >= 1.0 {
            bucket.left -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.left) / rate))
        }
    }

    /// Gives back a charge for what turned out not to be a failure.
    fn refund(&mut self, client: IpAddr) {
        let full = f64::from(self.per_minute);
        if let Some(bucket) = self.buckets.get_mut(&budget_key(client)) {
            bucket.left = (bucket.left + 1.0).min(full);
        }
    }
}

fn budget_key(client: IpAddr) -> IpAddr {
    match client.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
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

    fn key() -> tokens::ApiTokenKey {
        tokens::ApiTokenKey::from_base64(&tokens::ApiTokenKey::generate()).unwrap()
    }

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
        let auth = Authenticator::new(key(), Duration::from_secs(1), 2, 10, None).unwrap();
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

    #[test]
    fn failures_are_budgeted_per_address_and_refill_over_a_minute() {
        // Six a minute: one more every ten seconds.
        let mut budget = FailureBudget::new(6);
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        for _ in 0..6 {
            assert!(budget.charge(a, t0).is_ok());
        }
        let wait = budget.charge(a, t0).unwrap_err();
        assert!((wait.as_secs_f64() - 10.0).abs() < 1e-6, "{wait:?}");
        assert!(budget.charge(b, t0).is_ok(), "each address has its own");
        assert!(budget.charge(a, at(10)).is_ok());
        assert!(budget.charge(a, at(10)).is_err());
        budget.refund(a);
        assert!(budget.charge(a, at(10)).is_ok(), "a refund gives one back");
        // A minute later the budget is whole again, and no more than whole.
        for _ in 0..6 {
            assert!(budget.charge(a, at(300)).is_ok());
        }
        assert!(budget.charge(a, at(300)).is_err());
    }

    #[test]
    fn an_ipv6_client_is_budgeted_per_64_and_a_mapped_ipv4_one_as_ipv4() {
        let mut budget = FailureBudget::new(1);
        let now = Instant::now();
        let charge = |budget: &mut FailureBudget, ip: &str| budget.charge(ip.parse().unwrap(), now);
        assert!(charge(&mut budget, "2001:db8::1").is_ok());
        assert!(charge(&mut budget, "2001:db8::ffff:1").is_err(), "same /64");
        assert!(
            charge(&mut budget, "2001:db8:0:1::1").is_ok(),
            "another /64"
        );
        assert!(charge(&mut budget, "192.0.2.7").is_ok());
        assert!(
            charge(&mut budget, "::ffff:192.0.2.7").is_err(),
            "the same IPv4 client"
        );
    }

    #[test]
    fn the_auth_cache_lives_at_most_five_seconds() {
        assert!(Authenticator::new(key(), MAX_AUTH_CACHE_TTL, 1, 1, None).is_ok());
        let longer = MAX_AUTH_CACHE_TTL + Duration::from_millis(1);
        assert!(Authenticator::new(key(), longer, 1, 1, None).is_err());
    }

    #[test]
    fn the_client_is_the_peer_unless_a_proxy_header_is_configured_and_present() {
        let peer: SocketAddr = "198.51.100.4:5555".parse().unwrap();
        let request = |forwarded: Option<&str>| {
            let mut builder = Request::builder().extension(ConnectInfo(peer));
            if let Some(f) = forwarded {
                builder = builder.header("x-forwarded-for", f);
            }
            builder.body(axum::body::Body::empty()).unwrap()
        };
        let direct = Authenticator::new(key(), Duration::ZERO, 1, 1, None).unwrap();
        let proxied =
            Authenticator::new(key(), Duration::ZERO, 1, 1, Some("X-Forwarded-For")).unwrap();
        let forwarded = request(Some("203.0.113.9, 192.0.2.200"));
        assert_eq!(
            direct.client(&forwarded),
            peer.ip(),
            "the header is not trusted"
        );
        // The last entry is the one the proxy in front of central appended.
        assert_eq!(
            proxied.client(&forwarded),
            "192.0.2.200".parse::<IpAddr>().unwrap()
        );
        assert_eq!(proxied.client(&request(None)), peer.ip());
        assert_eq!(proxied.client(&request(Some("nonsense"))), peer.ip());
    }

    /// Whatever addresses they come from, never-seen legacy values are looked up at most at the
    /// replica's pace: a burst, then a steady rate.
    #[test]
    fn legacy_lookups_are_capped_per_replica() {
        let t0 = Instant::now();
        let mut bucket = Bucket {
            left: LEGACY_LOOKUP_BURST,
            at: t0,
        };
        let burst = (0..1000).take_while(|_| bucket.take(t0).is_ok()).count();
        assert_eq!(burst as f64, LEGACY_LOOKUP_BURST);
        let wait = bucket.take(t0).unwrap_err();
        assert!(wait <= Duration::from_secs_f64(1.0 / LEGACY_LOOKUPS_PER_SECOND));
        let later = t0 + Duration::from_secs(1);
        let more = (0..1000).take_while(|_| bucket.take(later).is_ok()).count();
        assert_eq!(more as f64, LEGACY_LOOKUPS_PER_SECOND);
    }
}

//! The Hub's HTTP API, as much of it as a control plane asks: who a token belongs to, a model
//! repository's info (at a revision), and its files through `resolve`.
//!
//! Errors are the Hub's: a status, `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`,
//! `GatedRepo`, `EntryNotFound`) where the Hub sends one, `X-Error-Message`, and a JSON body
//! `{"error": message}`. A request with an unknown or revoked token is refused whatever it asks
//! for (401, `Invalid credentials in Authorization header`). A repository that does not exist, or
//! that is private and the token cannot read, is "not found": 401 to an anonymous request, 404 to
//! an authenticated one. A gated repository's info is public; its files need a token with access
//! (401 without a token, 403 with one that has none).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use rand::Rng;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::repo::Repo;
use crate::Shared;

/// The Hub's answer to a request it refuses.
#[derive(Debug)]
pub(crate) enum HubErr {
    InvalidCredentials,
    RepoNotFound { authenticated: bool },
    RevisionNotFound(String),
    GatedRepo { id: String, authenticated: bool },
    EntryNotFound,
    NotFound,
    Internal,
    Unavailable,
    RateLimited(u64),
}

impl IntoResponse for HubErr {
    fn into_response(self) -> Response {
        let (status, code, message) = match self {
            HubErr::InvalidCredentials => (
                StatusCode::UNAUTHORIZED,
                None,
                "Invalid credentials in Authorization header".to_string(),
            ),
            HubErr::RepoNotFound { authenticated } => (
                if authenticated {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::UNAUTHORIZED
                },
                Some("RepoNotFound"),
                "Repository not found".to_string(),
            ),
            HubErr::RevisionNotFound(rev) => (
                StatusCode::NOT_FOUND,
                Some("RevisionNotFound"),
                format!("Invalid rev id: {rev}"),
            ),
            HubErr::GatedRepo {
                id,
                authenticated: false,
            } => (
                StatusCode::UNAUTHORIZED,
                Some("GatedRepo"),
                format!(
                    "Access to model {id} is restricted. You must have access to it and be \
                     authenticated to access it. Please log in."
                ),
            ),
            HubErr::GatedRepo {
                id,
                authenticated: true,
            } => (
                StatusCode::FORBIDDEN,
                Some("GatedRepo"),
                format!(
                    "Access to model {id} is restricted and you are not in the authorized list. \
                     Visit https://huggingface.co/{id} to ask for access."
                ),
            ),
            HubErr::EntryNotFound => (
                StatusCode::NOT_FOUND,
                Some("EntryNotFound"),
                "Entry not found".to_string(),
            ),
            HubErr::NotFound => (
                StatusCode::NOT_FOUND,
                None,
                "Sorry, we can't find the page you are looking for.".to_string(),
            ),
            HubErr::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                "Internal Error - We're working hard to fix this as soon as possible!".to_string(),
            ),
            HubErr::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                "Service Unavailable".to_string(),
            ),
            HubErr::RateLimited(secs) => {
                let mut resp = error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    None,
                    "You have exceeded our hourly quotas for action: api. We invite you to retry \
                     later.",
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                return resp;
            }
        };
        error_response(status, code, &message)
    }
}

fn error_response(status: StatusCode, code: Option<&'static str>, message: &str) -> Response {
    let mut resp = (status, Json(json!({ "error": message }))).into_response();
    let h = resp.headers_mut();
    if let Some(code) = code {
        h.insert("x-error-code", HeaderValue::from_static(code));
    }
    if let Ok(v) = HeaderValue::from_str(message) {
        h.insert("x-error-message", v);
    }
    resp
}

/// Who the request is from: nobody, or the holder of a valid token.
struct Caller {
    token: Option<String>,
}

impl Caller {
    fn authenticated(&self) -> bool {
        self.token.is_some()
    }
}

/// No `Authorization`: anonymous. Anything but `Bearer <known token>`: refused.
fn caller(s: &Shared, headers: &HeaderMap) -> Result<Caller, HubErr> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(Caller { token: None });
    };
    let token = value
        .to_str()
        .ok()
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        })
        .filter(|t| !t.is_empty())
        .ok_or(HubErr::InvalidCredentials)?;
    if s.read().tokens.contains_key(token) {
        Ok(Caller {
            token: Some(token.to_string()),
        })
    } else {
        Err(HubErr::InvalidCredentials)
    }
}

/// The repository if the caller may see it; "not found" as the Hub says it otherwise.
fn visible_repo(s: &Shared, id: &str, caller: &Caller) -> Result<Repo, HubErr> {
    let not_found = HubErr::RepoNotFound {
        authenticated: caller.authenticated(),
    };
    let hub = s.read();
    let repo = hub.repo(id).ok_or(not_found)?;
    if repo.private && !repo.can_read(caller.token.as_deref()) {
        return Err(HubErr::RepoNotFound {
            authenticated: caller.authenticated(),
        });
    }
    Ok(repo.clone())
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/api/whoami-v2", get(whoami))
        .route("/api/models/{org}/{name}", get(model_info))
        .route(
            "/api/models/{org}/{name}/revision/{revision}",
            get(model_info_at),
        )
        .route("/{org}/{name}/resolve/{revision}/{*path}", get(resolve))
        .fallback(|| async { HubErr::NotFound })
        .layer(middleware::from_fn_with_state(shared.clone(), faults))
        .with_state(shared)
}

/// Counts every Hub request and answers it with an injected fault when the faults say so.
async fn faults(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let kind = if path == "/api/whoami-v2" {
        "whoami"
    } else if path.starts_with("/api/models/") {
        "model_info"
    } else if path.contains("/resolve/") {
        "resolve"
    } else {
        "other"
    };
    s.requests.fetch_add(1, Ordering::SeqCst);
    *s.by_kind
        .lock()
        .expect("stats lock")
        .entry(kind.to_string())
        .or_default() += 1;
    let (latency, verdict) = {
        let mut f = s.faults.lock().expect("faults lock");
        let verdict = if f.fail_next > 0 {
            f.fail_next -= 1;
            Some(HubErr::Unavailable)
        } else {
            let sample = rand::thread_rng().gen::<f64>();
            let err = f.error_rate.clamp(0.0, 1.0);
            let limited = (err + f.rate_limit_rate.clamp(0.0, 1.0)).min(1.0);
            if sample < err {
                Some(HubErr::Internal)
            } else if sample < limited {
                Some(HubErr::RateLimited(f.retry_after_secs.max(1)))
            } else {
                None
            }
        };
        (f.latency_ms, verdict)
    };
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    match verdict {
        Some(e) => {
            s.faults_injected.fetch_add(1, Ordering::SeqCst);
            e.into_response()
        }
        None => next.run(req).await,
    }
}

async fn whoami(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Result<Response, HubErr> {
    let caller = caller(&s, &headers)?;
    let token = caller.token.ok_or(HubErr::InvalidCredentials)?;
    let info = s
        .read()
        .tokens
        .get(&token)
        .cloned()
        .ok_or(HubErr::InvalidCredentials)?;
    let user = &info.user;
    Ok(Json(json!({
        "type": "user",
        "id": object_id(user),
        "name": user,
        "fullname": user,
        "email": null,
        "emailVerified": false,
        "canPay": false,
        "periodEnd": null,
        "isPro": false,
        "avatarUrl": format!("/avatars/{}.svg", &object_id(user)[..12]),
        "orgs": [],
        "auth": {
            "type": "access_token",
            "accessToken": {
                "displayName": format!("{user}-read"),
                "role": "read",
                "createdAt": info.created_at,
            }
        }
    }))
    .into_response())
}

async fn model_info(
    State(s): State<Arc<Shared>>,
    Path((org, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, HubErr> {
    info_at(&s, &org, &name, "main", &headers)
}

async fn model_info_at(
    State(s): State<Arc<Shared>>,
    Path((org, name, revision)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Result<Response, HubErr> {
    info_at(&s, &org, &name, &revision, &headers)
}

/// A gated repository's info is public (it says `gated`); only its files are not.
fn info_at(
    s: &Shared,
    org: &str,
    name: &str,
    revision: &str,
    headers: &HeaderMap,
) -> Result<Response, HubErr> {
    let caller = caller(s, headers)?;
    let repo = visible_repo(s, &format!("{org}/{name}"), &caller)?;
    let (sha, config) = repo
        .resolve(revision)
        .ok_or_else(|| HubErr::RevisionNotFound(revision.to_string()))?;
    Ok(Json(model_info_json(&repo, &sha, config)).into_response())
}

/// The model info document, as `GET /api/models/{id}` returns it.
fn model_info_json(repo: &Repo, sha: &str, config: &Value) -> Value {
    let model_type = config.get("model_type").cloned().unwrap_or(Value::Null);
    let mut tags = vec!["transformers".to_string()];
    if !repo.safetensors.is_empty() {
        tags.push("safetensors".into());
    }
    if let Some(t) = model_type.as_str() {
        tags.push(t.to_string());
    }
    tags.extend(
        [
            "text-generation",
            "conversational",
            "text-generation-inference",
            "endpoints_compatible",
            "region:us",
        ]
        .map(String::from),
    );
    let mut info = json!({
        "_id": &object_id(&repo.id)[..24],
        "id": repo.id,
        "modelId": repo.id,
        "author": repo.author(),
        "sha": sha,
        "lastModified": repo.last_modified,
        "createdAt": repo.last_modified,
        "private": repo.private,
        "disabled": false,
        "gated": repo.gated,
        "downloads": 0,
        "likes": 0,
        "pipeline_tag": "text-generation",
        "library_name": "transformers",
        "tags": tags,
        "siblings": repo.files.iter().map(|f| json!({"rfilename": f})).collect::<Vec<_>>(),
        "spaces": [],
    });
    if config.is_object() {
        info["config"] = json!({
            "architectures": config.get("architectures").cloned().unwrap_or(json!([])),
            "model_type": model_type,
        });
        info["transformersInfo"] = json!({
            "auto_model": "AutoModelForCausalLM",
            "pipeline_tag": "text-generation",
            "processor": "AutoTokenizer",
        });
    }
    if !repo.safetensors.is_empty() {
        info["safetensors"] = json!({
            "parameters": repo.safetensors,
            "total": repo.safetensors.values().sum::<u64>(),
        });
    }
    info
}

/// `GET`/`HEAD /{org}/{name}/resolve/{revision}/{path}`. A differently-cased id is redirected
/// (307, relative) to the repository's own, as the Hub does.
async fn resolve(
    State(s): State<Arc<Shared>>,
    Path((org, name, revision, path)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Result<Response, HubErr> {
    let caller = caller(&s, &headers)?;
    let asked = format!("{org}/{name}");
    let repo = visible_repo(&s, &asked, &caller)?;
    if repo.id != asked {
        let location = format!(
            "/{}/resolve/{}/{}",
            repo.id,
            encode(&revision),
            path.split('/').map(encode).collect::<Vec<_>>().join("/")
        );
        return Ok((
            StatusCode::TEMPORARY_REDIRECT,
            [(header::LOCATION, location)],
        )
            .into_response());
    }
    if repo.gated.is_gated() && !repo.can_read(caller.token.as_deref()) {
        return Err(HubErr::GatedRepo {
            id: repo.id.clone(),
            authenticated: caller.authenticated(),
        });
    }
    let (sha, config) = repo
        .resolve(&revision)
        .ok_or_else(|| HubErr::RevisionNotFound(revision.clone()))?;
    if !repo.files.contains(&path) {
        return Err(HubErr::EntryNotFound);
    }
    let body = file_bytes(&repo, &sha, config, &path);
    let etag = format!("\"{}\"", &object_id_bytes(&body)[..40]);
    let content_type = if path.ends_with(".json") {
        "application/json"
    } else if path.ends_with(".md") || path.ends_with(".txt") || path.starts_with('.') {
        "text/plain; charset=utf-8"
    } else {
        "application/octet-stream"
    };
    // axum answers HEAD with the headers of GET (Content-Length included) and no body.
    let len = body.len();
    let mut resp = Response::new(Body::from(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    h.insert(
        header::ETAG,
        HeaderValue::from_str(&etag).expect("hex etag"),
    );
    h.insert(
        "x-repo-commit",
        HeaderValue::from_str(&sha).expect("hex sha"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    Ok(resp)
}

/// `config.json` as stored; other files small placeholders (weights are not simulated).
fn file_bytes(repo: &Repo, sha: &str, config: &Value, path: &str) -> Vec<u8> {
    match path {
        "config.json" => serde_json::to_vec_pretty(config).expect("JSON value"),
        "model.safetensors.index.json" => serde_json::to_vec_pretty(&json!({
            "metadata": {"total_size": repo.safetensors.values().sum::<u64>() * 2},
            "weight_map": {},
        }))
        .expect("JSON value"),
        p if p.ends_with(".json") => b"{}\n".to_vec(),
        "README.md" => format!("# {}\n\nServed by hub-sim.\n", repo.id).into_bytes(),
        p => format!("hub-sim placeholder for {}/{p} at {sha}\n", repo.id).into_bytes(),
    }
}

/// A stable hex id for `seed` (the Hub's `_id`s are 24 hex digits).
fn object_id(seed: &str) -> String {
    object_id_bytes(seed.as_bytes())
}

fn object_id_bytes(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Percent-encodes a path segment.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

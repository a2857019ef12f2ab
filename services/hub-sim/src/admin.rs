//! `/_sim/`: what tests and scripts do to the simulated Hub, in JSON. Not part of the Hub's API;
//! faults and request counts do not apply to it.
//!
//! | route | body | answer |
//! |---|---|---|
//! | `GET /_sim/repos` | | ids |
//! | `POST /_sim/repos` | a [`Repo`] (only `id` required) | the repo as stored |
//! | `POST /_sim/models` | a [`ModelSpec`] | the plausible repo made from it |
//! | `GET`, `DELETE /_sim/repos/{org}/{name}` | | the repo / 204 |
//! | `PUT /_sim/repos/{org}/{name}/gated` | `{"gated": false \| "auto" \| "manual"}` | the repo |
//! | `PUT /_sim/repos/{org}/{name}/private` | `{"private": bool}` | the repo |
//! | `POST /_sim/repos/{org}/{name}/grants` | `{"token": "hf_..."}` | the repo |
//! | `POST /_sim/repos/{org}/{name}/revisions` | `{"name": "dev", "config": {...}?}` | `{"name", "sha"}` |
//! | `POST /_sim/tokens` | `{"token": "hf_...", "user": "alice"}` | 204 |
//! | `POST /_sim/tokens/revoke` | `{"token": "hf_..."}` | 204 |
//! | `GET`, `PUT /_sim/faults` | a [`HubFaults`] (PUT replaces them all; absent fields are 0) | the faults |
//! | `GET /_sim/stats` | | a [`HubStats`] |
//!
//! Errors: 400 or 404 with `{"error": message}`. Tokens travel in bodies, not paths, so that
//! access logs do not hold them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::repo::{Gated, ModelSpec, Repo};
use crate::{HubFaults, Shared};

struct AdminErr(StatusCode, String);

impl IntoResponse for AdminErr {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

fn bad(e: impl std::fmt::Display) -> AdminErr {
    AdminErr(StatusCode::BAD_REQUEST, e.to_string())
}

fn missing(e: impl std::fmt::Display) -> AdminErr {
    AdminErr(StatusCode::NOT_FOUND, e.to_string())
}

type AdminResult = Result<Response, AdminErr>;

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, AdminErr> {
    serde_json::from_slice(body).map_err(|e| bad(format!("body: {e}")))
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/_sim/repos", get(list).post(publish))
        .route("/_sim/models", post(publish_model))
        .route("/_sim/repos/{org}/{name}", get(show).delete(remove))
        .route("/_sim/repos/{org}/{name}/gated", put(set_gated))
        .route("/_sim/repos/{org}/{name}/private", put(set_private))
        .route("/_sim/repos/{org}/{name}/grants", post(grant))
        .route("/_sim/repos/{org}/{name}/revisions", post(push_revision))
        .route("/_sim/tokens", post(add_token))
        .route("/_sim/tokens/revoke", post(revoke_token))
        .route("/_sim/faults", get(faults_get).put(faults_put))
        .route("/_sim/stats", get(stats))
        .with_state(shared)
}

async fn list(State(s): State<Arc<Shared>>) -> Response {
    let ids: Vec<String> = s.read().repos.values().map(|r| r.id.clone()).collect();
    Json(ids).into_response()
}

async fn publish(State(s): State<Arc<Shared>>, body: Bytes) -> AdminResult {
    let repo: Repo = parse(&body)?;
    let stored = s.publish(repo).map_err(bad)?;
    Ok((StatusCode::CREATED, Json(stored)).into_response())
}

async fn publish_model(State(s): State<Arc<Shared>>, body: Bytes) -> AdminResult {
    let spec: ModelSpec = parse(&body)?;
    let stored = s.publish(Repo::from_spec(&spec)).map_err(bad)?;
    Ok((StatusCode::CREATED, Json(stored)).into_response())
}

fn current(s: &Shared, id: &str) -> AdminResult {
    let hub = s.read();
    let repo = hub
        .repo(id)
        .ok_or_else(|| missing(format!("no repository {id}")))?;
    Ok(Json(repo).into_response())
}

async fn show(
    State(s): State<Arc<Shared>>,
    Path((org, name)): Path<(String, String)>,
) -> AdminResult {
    current(&s, &format!("{org}/{name}"))
}

async fn remove(
    State(s): State<Arc<Shared>>,
    Path((org, name)): Path<(String, String)>,
) -> AdminResult {
    let id = format!("{org}/{name}");
    if s.remove(&id) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(missing(format!("no repository {id}")))
    }
}

/// A repository's `{org}/{name}`.
type RepoPath = Path<(String, String)>;

/// Parses the body as `B`, applies it to the repository with `f`, and answers with the
/// repository.
fn update_with<B: DeserializeOwned>(
    s: &Shared,
    Path((org, name)): RepoPath,
    body: &Bytes,
    f: impl FnOnce(&mut Repo, B),
) -> AdminResult {
    let b: B = parse(body)?;
    let id = format!("{org}/{name}");
    s.update(&id, |r| f(r, b)).map_err(missing)?;
    current(s, &id)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GatedBody {
    gated: Gated,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrivateBody {
    private: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    token: String,
}

async fn set_gated(State(s): State<Arc<Shared>>, repo: RepoPath, body: Bytes) -> AdminResult {
    update_with(&s, repo, &body, |r, b: GatedBody| r.gated = b.gated)
}

async fn set_private(State(s): State<Arc<Shared>>, repo: RepoPath, body: Bytes) -> AdminResult {
    update_with(&s, repo, &body, |r, b: PrivateBody| r.private = b.private)
}

async fn grant(State(s): State<Arc<Shared>>, repo: RepoPath, body: Bytes) -> AdminResult {
    update_with(&s, repo, &body, |r, b: TokenBody| {
        r.granted.insert(b.token);
    })
}

async fn push_revision(
    State(s): State<Arc<Shared>>,
    Path((org, name)): Path<(String, String)>,
    body: Bytes,
) -> AdminResult {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        name: String,
        #[serde(default)]
        config: Option<Value>,
    }
    let b: Body = parse(&body)?;
    let id = format!("{org}/{name}");
    if s.read().repo(&id).is_none() {
        return Err(missing(format!("no repository {id}")));
    }
    let sha = s.push_revision(&id, &b.name, b.config).map_err(bad)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"name": b.name, "sha": sha})),
    )
        .into_response())
}

async fn add_token(State(s): State<Arc<Shared>>, body: Bytes) -> AdminResult {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        token: String,
        user: String,
    }
    let b: Body = parse(&body)?;
    s.add_token(&b.token, &b.user).map_err(bad)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn revoke_token(State(s): State<Arc<Shared>>, body: Bytes) -> AdminResult {
    let b: TokenBody = parse(&body)?;
    if s.revoke_token(&b.token) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(missing("no such token"))
    }
}

async fn faults_get(State(s): State<Arc<Shared>>) -> Response {
    Json(s.faults.lock().expect("faults lock").clone()).into_response()
}

async fn faults_put(State(s): State<Arc<Shared>>, body: Bytes) -> AdminResult {
    let f: HubFaults = parse(&body)?;
    *s.faults.lock().expect("faults lock") = f.clone();
    Ok(Json(f).into_response())
}

async fn stats(State(s): State<Arc<Shared>>) -> Response {
    Json(s.stats()).into_response()
}

//! The OpenAI-compatible API an endpoint answers, as vLLM would: the router and the
//! `/v1/models`, `/v1/chat/completions` and `/v1/completions` handlers, which parse the
//! request, generate the answer and hand it to the serving model when it is on. The API's
//! shape, apart from the gateway's checks before it and the pacing of the answer after it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::admission::{admit, Admitted};
use super::endpoint::Inner;
use super::pacing::{answer_after, answer_stream, answer_within, cut_at, route_timed_out};
use super::{count_tokens, generate_at_least, oai_error, Backend, Generation, ModelTiming};

pub(super) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(fallback)
        .with_state(inner.clone())
        .layer(axum::middleware::map_response_with_state(
            inner,
            |State(inner): State<Arc<Inner>>, resp: Response| async move {
                let overrides = inner
                    .config
                    .read()
                    .expect("endpoint lock")
                    .overrides
                    .clone();
                crate::overrides::apply(&overrides, resp)
            },
        ))
}

fn with_backend(mut resp: Response, backend: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(backend) {
        resp.headers_mut().insert("x-sim-backend", v);
    }
    resp
}

async fn fallback(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    match admit(&inner, req.uri().path(), req.headers()).await {
        Err(r) => r,
        Ok(a) => with_backend(
            oai_error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                json!(404),
                format!("{} {} is not served", req.method(), req.uri().path()),
            ),
            &a.backend,
        ),
    }
}

async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let a = match admit(&inner, "/v1/models", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mut names: Vec<String> = a.backends.iter().filter_map(|b| b.model.clone()).collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        names.push("model".into());
    }
    let created = chrono::Utc::now().timestamp();
    let data: Vec<Value> = names
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": name, "parent": null, "max_model_len": 8192,
            })
        })
        .collect();
    with_backend(
        Json(json!({"object": "list", "data": data})).into_response(),
        &a.backend,
    )
}

fn bad_request(msg: impl Into<String>) -> Response {
    oai_error(StatusCode::BAD_REQUEST, "BadRequestError", json!(400), msg)
}

/// The request fields both completion APIs share.
struct Common {
    body: Value,
    model: String,
    max_tokens: Option<u32>,
    /// vLLM's `min_tokens`, or `max_tokens` with `ignore_eos`: the answer is at least this long.
    min_tokens: u32,
    stream: bool,
    include_usage: bool,
}

/// Parses the common request fields, checks the model name the way vLLM does and sends the
/// request to a pod serving that model.
fn common(body: &Bytes, a: &mut Admitted) -> Result<Common, Box<Response>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Box::new(bad_request(format!("request body is not valid JSON: {e}"))))?;
    if !v.is_object() {
        return Err(Box::new(bad_request("request body must be a JSON object")));
    }
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| Box::new(bad_request("`model` is required")))?
        .to_string();
    let serving: Vec<&Backend> = a
        .backends
        .iter()
        .filter(|b| b.model.as_deref().is_none_or(|m| m == model))
        .collect();
    if serving.is_empty() {
        return Err(Box::new(oai_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            json!(404),
            format!("The model `{model}` does not exist."),
        )));
    }
    a.backend = serving[a.turn % serving.len()].pod.clone();
    let max = v
        .get("max_completion_tokens")
        .filter(|m| !m.is_null())
        .or_else(|| v.get("max_tokens").filter(|m| !m.is_null()));
    let max_tokens = match max {
        None => None,
        Some(m) => match m.as_u64() {
            Some(n) if n >= 1 => Some(n.min(65_536) as u32),
            _ => {
                return Err(Box::new(bad_request(
                    "max_tokens must be a positive integer",
                )))
            }
        },
    };
    let min_tokens = if v.get("ignore_eos").and_then(Value::as_bool) == Some(true) {
        max_tokens.unwrap_or(0)
    } else {
        v.get("min_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(65_536) as u32
    };
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    })
}

fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

async fn chat(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut a = match admit(&inner, "/v1/chat/completions", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    } = match common(&body, &mut a) {
        Ok(x) => x,
        Err(r) => return with_backend(*r, &a.backend),
    };
    let Some(messages) = v.get("messages").and_then(Value::as_array) else {
        return with_backend(bad_request("`messages` is required"), &a.backend);
    };
    if messages.is_empty() {
        return with_backend(bad_request("`messages` must not be empty"), &a.backend);
    }
    let mut prompt = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        prompt.push_str(role);
        prompt.push_str(": ");
        prompt.push_str(&content_text(m.get("content").unwrap_or(&Value::Null)));
        prompt.push('\n');
    }
    let prompt_tokens = count_tokens(&prompt) + 3 * messages.len() as u32;
    let gen = generate_at_least(&model, &prompt, max_tokens, min_tokens);
    let timing = inner.timing.read().expect("timing lock").clone();
    let tokens = crate::serving::chat_tokens(&prompt);
    let session = match serve(&timing, &mut a, &model, tokens, &gen) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.tokens.len(),
        "total_tokens": prompt_tokens as usize + gen.tokens.len(),
    });
    if stream {
        let base = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        let chunk = move |delta: Value, finish: Value| {
            let mut c = base.clone();
            c["choices"] =
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
            c
        };
        let mut events = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        for t in &gen.tokens {
            events.push(chunk(json!({"content": t}), Value::Null));
        }
        events.push(chunk(json!({}), json!(gen.finish_reason)));
        if include_usage {
            let mut u = chunk(json!({}), Value::Null);
            u["choices"] = json!([]);
            u["usage"] = usage;
            events.push(u);
        }
        let deadline = a.deadline(&timing);
        let answer = answer_stream(session, events, timing, 1);
        return with_backend(cut_at(answer, deadline), &a.backend);
    }
    let deadline = a.deadline(&timing);
    if !answer_within(deadline, answer_after(session, &timing, gen.tokens.len())).await {
        return with_backend(route_timed_out(), &a.backend);
    }
    with_backend(
        Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": gen.tokens.concat(), "tool_calls": []},
                "logprobs": null,
                "finish_reason": gen.finish_reason,
            }],
            "usage": usage,
        }))
        .into_response(),
        &a.backend,
    )
}

async fn completions(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut a = match admit(&inner, "/v1/completions", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    } = match common(&body, &mut a) {
        Ok(x) => x,
        Err(r) => return with_backend(*r, &a.backend),
    };
    let prompt = match v.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| i.to_string())
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => return with_backend(bad_request("`prompt` is required"), &a.backend),
    };
    // vLLM's default for /v1/completions is 16 tokens, as in OpenAI's legacy API.
    let gen = generate_at_least(&model, &prompt, Some(max_tokens.unwrap_or(16)), min_tokens);
    let prompt_tokens = count_tokens(&prompt);
    let timing = inner.timing.read().expect("timing lock").clone();
    let tokens = crate::serving::tokenize(&prompt);
    let session = match serve(&timing, &mut a, &model, tokens, &gen) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.tokens.len(),
        "total_tokens": prompt_tokens as usize + gen.tokens.len(),
    });
    if stream {
        let base =
            json!({"id": id, "object": "text_completion", "created": created, "model": model});
        let chunk = move |text: &str, finish: Value| {
            let mut c = base.clone();
            c["choices"] =
                json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]);
            c
        };
        let mut events: Vec<Value> = gen.tokens.iter().map(|t| chunk(t, Value::Null)).collect();
        events.push(chunk("", json!(gen.finish_reason)));
        if include_usage {
            let mut u = chunk("", Value::Null);
            u["choices"] = json!([]);
            u["usage"] = usage;
            events.push(u);
        }
        let deadline = a.deadline(&timing);
        let answer = answer_stream(session, events, timing, 0);
        return with_backend(cut_at(answer, deadline), &a.backend);
    }
    let deadline = a.deadline(&timing);
    if !answer_within(deadline, answer_after(session, &timing, gen.tokens.len())).await {
        return with_backend(route_timed_out(), &a.backend);
    }
    with_backend(
        Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": gen.tokens.concat(), "logprobs": null, "finish_reason": gen.finish_reason}],
            "usage": usage,
        }))
        .into_response(),
        &a.backend,
    )
}

/// Hands the request to the serving model when it is on ([`crate::serving::start`]): the pod
/// its picker chose answers it. `Err`: the answer already (a request no replica could hold).
fn serve(
    timing: &ModelTiming,
    a: &mut Admitted,
    model: &str,
    tokens: Vec<u64>,
    gen: &Generation,
) -> Result<Option<crate::serving::Session>, Box<Response>> {
    match crate::serving::start(&timing.serving, &a.backends, model, a.turn, tokens, gen) {
        Some(Err(e)) => Err(Box::new(with_backend(bad_request(e), &a.backend))),
        Some(Ok(s)) => {
            a.backend = s.pod().to_string();
            Ok(Some(s))
        }
        None => Ok(None),
    }
}

//! When an answer goes out: at the serving model's pace or after the fixed delays of
//! [`ModelTiming`], as server-sent events or whole, and cut at the route's timeout as Envoy
//! cuts it. Time and streams, apart from the answer's content.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::Value;

use super::ModelTiming;

/// Streams `events` at the serving model's pace, else after the fixed delays.
pub(super) fn answer_stream(
    session: Option<crate::serving::Session>,
    events: Vec<Value>,
    timing: ModelTiming,
    preamble: usize,
) -> Response {
    match session {
        Some(s) => s.sse(events, preamble),
        None => sse(events, timing, preamble),
    }
}

/// Whether `answer` is done before the route's `deadline`.
pub(super) async fn answer_within(
    deadline: Option<tokio::time::Instant>,
    answer: impl Future<Output = ()>,
) -> bool {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, answer).await.is_ok(),
        None => {
            answer.await;
            true
        }
    }
}

/// Envoy's answer when the route's timeout passes before the upstream's headers.
pub(super) fn route_timed_out() -> Response {
    (StatusCode::GATEWAY_TIMEOUT, "upstream request timeout").into_response()
}

/// `resp` with its body cut at the route's `deadline`, as Envoy resets a stream whose timeout
/// passes after the headers went out: the client sees the body end in an error, not a clean end.
pub(super) fn cut_at(resp: Response, deadline: Option<tokio::time::Instant>) -> Response {
    let Some(deadline) = deadline else {
        return resp;
    };
    let (parts, body) = resp.into_parts();
    let body = futures::stream::unfold(Some(body.into_data_stream()), move |state| async move {
        let mut data = state?;
        tokio::select! {
            next = data.next() => next.map(|r| (r.map_err(std::io::Error::other), Some(data))),
            () = tokio::time::sleep_until(deadline) => {
                Some((Err(std::io::Error::other("upstream request timeout")), None))
            }
        }
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// Waits until the whole answer is generated.
pub(super) async fn answer_after(
    session: Option<crate::serving::Session>,
    t: &ModelTiming,
    tokens: usize,
) {
    match session {
        Some(s) => s.finish().await,
        None => sleep_for(t, tokens).await,
    }
}

async fn sleep_for(t: &ModelTiming, tokens: usize) {
    let total = t.ttft_ms + t.per_token_ms * tokens.saturating_sub(1) as u64;
    if total > 0 {
        tokio::time::sleep(Duration::from_millis(total)).await;
    }
}

/// Server-sent events: `data: {json}` per chunk, then `data: [DONE]`. The first `preamble`
/// events (the role announcement) go out at once; the first token waits for the TTFT, the rest
/// for the per-token delay.
fn sse(events: Vec<Value>, timing: ModelTiming, preamble: usize) -> Response {
    let stream = sse_stream(events, timing, preamble);
    Sse::new(stream).into_response()
}

fn sse_stream(
    events: Vec<Value>,
    timing: ModelTiming,
    preamble: usize,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let total = events.len();
    futures::stream::unfold(
        (events.into_iter(), 0usize, false),
        move |(mut it, i, done)| {
            let timing = timing.clone();
            async move {
                if done {
                    return None;
                }
                match it.next() {
                    Some(ev) => {
                        let wait = if i < preamble {
                            0
                        } else if i == preamble {
                            timing.ttft_ms
                        } else if i + 1 < total {
                            timing.per_token_ms
                        } else {
                            0
                        };
                        if wait > 0 {
                            tokio::time::sleep(Duration::from_millis(wait)).await;
                        }
                        Some((
                            Ok(Event::default().data(ev.to_string())),
                            (it, i + 1, false),
                        ))
                    }
                    None => Some((Ok(Event::default().data("[DONE]")), (it, i + 1, true))),
                }
            }
        },
    )
}

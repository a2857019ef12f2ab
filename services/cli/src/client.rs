//! The HTTP client of the public API: a typed client, one method per operation of
//! `openapi/public.json` (held to it by a test), and the only place a URL is built. Bearer auth,
//! retries that are safe (transport errors on idempotent or keyed requests, 429/503 after
//! `Retry-After`), and the mapping of answers to `Failure`s.

use std::future::Future;
use std::time::Duration;

use api_types::operations::{Method, Operation, PathValue};
use api_types::public::{
    AcceleratorInfo, AcceleratorList, CaResponse, CreateResponse, DedicatedInferenceEnvelope,
    DedicatedInferenceList, EventList, GpuModelConfigsResponse, QuotasResponse, SizesResponse,
    TokenEnvelope, TokenList,
};
use reqwest::StatusCode;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::Serialize;
use serde_json::{json, Map, Value};
use uuid::Uuid;

use crate::Failure;

/// Retries after 429/503 before giving up.
const BUSY_RETRIES: u32 = 4;
/// Attempts when the API cannot be reached at all.
const TRANSPORT_ATTEMPTS: u32 = 3;
/// The longest `Retry-After` we honour; a longer one is capped.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// Page size for the list endpoints (the API's maximum). `DICTL_PER_PAGE` lowers it, so tests
/// can cross page boundaries with a few items.
const PER_PAGE: usize = 200;

pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    per_page: usize,
}

/// A successful answer. `typed` is the body decoded as the document says, so an answer of
/// another shape is an error rather than a view full of blanks; `body` is the same JSON as sent
/// (`Null` when empty), which the renderers read; `raw` is its text exactly as sent, for
/// `--output json`.
pub struct Answer<T> {
    pub typed: T,
    pub body: Value,
    pub raw: String,
}

/// An answer the document gives no body (`202`/`204` of a delete): whatever comes is accepted,
/// and `raw` still holds it.
pub type NoContent = IgnoredAny;

/// A path parameter. Ids come from the user, and anything but a plain id (ASCII letters, digits,
/// `-`, `_`) would change the URL's meaning, so it is refused before any request and needs no
/// escaping. Not parsed as a UUID: the API answers an id of another form with its own 404.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Id(String);

impl Id {
    pub fn parse(text: &str) -> Result<Id, Failure> {
        if text.is_empty()
            || !text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(Failure::Usage(format!("{text:?} is not a valid id")));
        }
        Ok(Id(text.to_string()))
    }
}

impl std::fmt::Display for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parsed to letters, digits, `-` and `_`: nothing that could change a path.
impl PathValue for Id {}

impl From<Uuid> for Id {
    fn from(id: Uuid) -> Id {
        Id(id.to_string())
    }
}

/// The filters of `dedicatedInferences_list`.
#[derive(Default)]
pub struct ListFilter {
    pub region: Option<String>,
    pub name: Option<String>,
}

/// The query of `dedicatedInferences_list`, in the order dictl always sent it.
#[derive(Serialize)]
struct ListQuery<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    region: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    page: usize,
    per_page: usize,
}

/// The query of the other list operations.
#[derive(Serialize)]
struct PageQuery {
    page: usize,
    per_page: usize,
}

/// A page of a list operation. Its items are handed on as JSON: `--output json` prints them as
/// sent, fields this dictl does not know included.
pub trait Listing: DeserializeOwned {
    /// The field that holds the items.
    const ITEMS: &'static str;
    fn total(&self) -> i64;
}

impl Listing for DedicatedInferenceList {
    const ITEMS: &'static str = "dedicated_inferences";
    fn total(&self) -> i64 {
        self.meta.total
    }
}

impl Listing for AcceleratorList {
    const ITEMS: &'static str = "accelerators";
    fn total(&self) -> i64 {
        self.meta.total
    }
}

impl Listing for EventList {
    const ITEMS: &'static str = "events";
    fn total(&self) -> i64 {
        self.meta.total
    }
}

impl Listing for TokenList {
    const ITEMS: &'static str = "tokens";
    fn total(&self) -> i64 {
        self.meta.total
    }
}

impl<L: Listing> Answer<L> {
    /// The page's items as sent.
    pub fn items(&self) -> Vec<Value> {
        self.body[L::ITEMS].as_array().cloned().unwrap_or_default()
    }
}

impl Client {
    pub fn new(base: &str, token: String) -> Result<Client, Failure> {
        let base = base.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Failure::Usage(format!(
                "--api-url must start with http:// or https:// (got {base:?})"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(60))
            .user_agent(concat!("dictl/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Failure::Unreachable(format!("cannot build the HTTP client: {e}")))?;
        let per_page = std::env::var("DICTL_PER_PAGE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=PER_PAGE).contains(n))
            .unwrap_or(PER_PAGE);
        Ok(Client {
            http,
            base,
            token,
            per_page,
        })
    }

    pub fn per_page(&self) -> usize {
        self.per_page
    }

    // One method per operation of the public API (`openapi/public.json`), each with the types
    // of the document; the test below holds the table of operations to the document. Request
    // bodies from the user's files stay JSON maps: the API validates them, and a field a newer
    // API understands must not be dropped on the way.

    pub async fn list(
        &self,
        filter: &ListFilter,
        page: usize,
    ) -> Result<Answer<DedicatedInferenceList>, Failure> {
        let query = ListQuery {
            region: filter.region.as_deref(),
            name: filter.name.as_deref(),
            page,
            per_page: self.per_page,
        };
        self.send(&LIST, &[], Some(&query), NO_BODY).await
    }

    pub async fn create(
        &self,
        body: &Map<String, Value>,
    ) -> Result<Answer<CreateResponse>, Failure> {
        self.send(&CREATE, &[], NO_QUERY, Some(body)).await
    }

    pub async fn gpu_model_config(&self) -> Result<Answer<GpuModelConfigsResponse>, Failure> {
        self.send(&GPU_MODEL_CONFIG, &[], NO_QUERY, NO_BODY).await
    }

    // No command shows the quotas yet; the method is here so that every operation of the
    // document has one.
    #[allow(dead_code)]
    pub async fn quotas(&self) -> Result<Answer<QuotasResponse>, Failure> {
        self.send(&QUOTAS, &[], NO_QUERY, NO_BODY).await
    }

    pub async fn sizes(&self) -> Result<Answer<SizesResponse>, Failure> {
        self.send(&SIZES, &[], NO_QUERY, NO_BODY).await
    }

    pub async fn get(&self, id: &Id) -> Result<Answer<DedicatedInferenceEnvelope>, Failure> {
        self.send(&GET, &[id], NO_QUERY, NO_BODY).await
    }

    pub async fn delete(&self, id: &Id) -> Result<Answer<NoContent>, Failure> {
        self.send(&DELETE, &[id], NO_QUERY, NO_BODY).await
    }

    pub async fn patch(
        &self,
        id: &Id,
        body: &Map<String, Value>,
    ) -> Result<Answer<DedicatedInferenceEnvelope>, Failure> {
        self.send(&PATCH, &[id], NO_QUERY, Some(body)).await
    }

    pub async fn accelerators(
        &self,
        id: &Id,
        page: usize,
    ) -> Result<Answer<AcceleratorList>, Failure> {
        let query = self.page_query(page);
        self.send(&ACCELERATORS, &[id], Some(&query), NO_BODY).await
    }

    // No command shows one accelerator (`accelerators` lists them all); the method is here so
    // that every operation of the document has one.
    #[allow(dead_code)]
    pub async fn accelerator(
        &self,
        id: &Id,
        accelerator_id: &Id,
    ) -> Result<Answer<AcceleratorInfo>, Failure> {
        self.send(&ACCELERATOR, &[id, accelerator_id], NO_QUERY, NO_BODY)
            .await
    }

    pub async fn ca(&self, id: &Id) -> Result<Answer<CaResponse>, Failure> {
        self.send(&CA, &[id], NO_QUERY, NO_BODY).await
    }

    pub async fn events(&self, id: &Id, page: usize) -> Result<Answer<EventList>, Failure> {
        let query = self.page_query(page);
        self.send(&EVENTS, &[id], Some(&query), NO_BODY).await
    }

    pub async fn tokens(&self, id: &Id, page: usize) -> Result<Answer<TokenList>, Failure> {
        let query = self.page_query(page);
        self.send(&TOKENS, &[id], Some(&query), NO_BODY).await
    }

    pub async fn token_create(
        &self,
        id: &Id,
        name: &str,
    ) -> Result<Answer<TokenEnvelope>, Failure> {
        self.send(
            &TOKEN_CREATE,
            &[id],
            NO_QUERY,
            Some(&json!({ "name": name })),
        )
        .await
    }

    pub async fn token_revoke(&self, id: &Id, token_id: &Id) -> Result<Answer<NoContent>, Failure> {
        self.send(&TOKEN_REVOKE, &[id, token_id], NO_QUERY, NO_BODY)
            .await
    }

    /// Every page of a list operation (`fetch` asks for one by number, from 1): the items, and
    /// the total the API reported.
    pub async fn every_page<L, F, A>(&self, mut fetch: F) -> Result<(Vec<Value>, i64), Failure>
    where
        L: Listing,
        F: FnMut(usize) -> A,
        A: Future<Output = Result<Answer<L>, Failure>>,
    {
        let mut items = Vec::new();
        let mut total = 0;
        for page in 1.. {
            let answer = fetch(page).await?;
            total = answer.typed.total();
            let batch = answer.items();
            let short = batch.len() < self.per_page;
            items.extend(batch);
            if short || items.len() as i64 >= total {
                break;
            }
        }
        Ok((items, total))
    }

    fn page_query(&self, page: usize) -> PageQuery {
        PageQuery {
            page,
            per_page: self.per_page,
        }
    }

    /// Sends `operation` with `ids` in its path parameters, in order. A write (anything but a
    /// GET) carries a fresh `Idempotency-Key`, the same on every retry, so a retry can never
    /// apply it twice.
    async fn send<Q: Serialize, B: Serialize, T: DeserializeOwned>(
        &self,
        operation: &Operation,
        ids: &[&dyn PathValue],
        query: Option<&Q>,
        body: Option<&B>,
    ) -> Result<Answer<T>, Failure> {
        let url = format!("{}{}", self.base, operation.path_with(ids));
        let key = (operation.method != Method::GET).then(|| Uuid::new_v4().to_string());
        let mut busy = 0;
        let mut transport = 0;
        loop {
            let mut req = self
                .http
                .request(operation.method.clone(), &url)
                .bearer_auth(&self.token)
                .header("accept", "application/json");
            if let Some(query) = query {
                req = req.query(query);
            }
            if let Some(key) = &key {
                req = req.header("idempotency-key", key);
            }
            if let Some(body) = body {
                req = req.json(body);
            }
            let response = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    transport += 1;
                    // Safe to repeat: GETs are reads, every write carries its Idempotency-Key.
                    if transport < TRANSPORT_ATTEMPTS && (e.is_connect() || e.is_timeout()) {
                        tokio::time::sleep(Duration::from_millis(300 * (1 << transport))).await;
                        continue;
                    }
                    return Err(Failure::Unreachable(format!(
                        "cannot reach the API at {}: {}",
                        self.base,
                        describe(&e)
                    )));
                }
            };
            let status = response.status();
            if (status == StatusCode::TOO_MANY_REQUESTS
                || status == StatusCode::SERVICE_UNAVAILABLE)
                && busy < BUSY_RETRIES
            {
                busy += 1;
                let wait = retry_after(response.headers()).unwrap_or(Duration::from_secs(1));
                eprintln!(
                    "dictl: the API answered {} ; retrying in {}s ({busy}/{BUSY_RETRIES})",
                    status.as_u16(),
                    wait.as_secs().max(1)
                );
                tokio::time::sleep(wait).await;
                continue;
            }
            let header_request_id = response
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let bytes = match response.bytes().await {
                Ok(b) => b,
                Err(e) => {
                    return Err(Failure::Unreachable(format!(
                        "the API's answer was cut off: {}",
                        describe(&e)
                    )))
                }
            };
            let parsed: Option<Value> = if bytes.is_empty() {
                Some(Value::Null)
            } else {
                serde_json::from_slice(&bytes).ok()
            };
            if status.is_success() {
                let body = parsed.ok_or_else(|| Failure::Api {
                    status: status.as_u16(),
                    id: "invalid_response".into(),
                    message: "the API answered with something that is not JSON".into(),
                    request_id: header_request_id.clone().unwrap_or_default(),
                })?;
                let typed = T::deserialize(&body).map_err(|e| Failure::Api {
                    status: status.as_u16(),
                    id: "invalid_response".into(),
                    message: format!(
                        "the API's answer to {} is not what openapi/public.json describes: {e}",
                        operation.id
                    ),
                    request_id: header_request_id.clone().unwrap_or_default(),
                })?;
                return Ok(Answer {
                    typed,
                    body,
                    raw: String::from_utf8_lossy(&bytes).into_owned(),
                });
            }
            let body = parsed.unwrap_or(Value::Null);
            let text = |v: &Value| v.as_str().map(str::to_owned);
            return Err(Failure::Api {
                status: status.as_u16(),
                id: text(&body["id"])
                    .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").into()),
                message: text(&body["message"]).unwrap_or_else(|| {
                    let raw = String::from_utf8_lossy(&bytes);
                    let raw = raw.trim();
                    if raw.is_empty() {
                        format!("HTTP {}", status.as_u16())
                    } else {
                        raw.chars().take(500).collect()
                    }
                }),
                request_id: text(&body["request_id"])
                    .or(header_request_id)
                    .unwrap_or_default(),
            });
        }
    }
}

/// `Retry-After` in seconds (the API's form), capped.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let secs: u64 = headers
        .get("retry-after")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// The innermost cause of a transport error (reqwest's own message is generic).
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text = s.to_string();
        source = s.source();
    }
    text
}

const fn op(id: &'static str, method: Method, path: &'static str) -> Operation {
    Operation::new(id, method, path)
}

const LIST: Operation = op(
    "dedicatedInferences_list",
    Method::GET,
    "/v2/dedicated-inferences",
);
const CREATE: Operation = op(
    "dedicatedInferences_create",
    Method::POST,
    "/v2/dedicated-inferences",
);
const GPU_MODEL_CONFIG: Operation = op(
    "dedicatedInferences_get_gpu_model_config",
    Method::GET,
    "/v2/dedicated-inferences/gpu-model-config",
);
const QUOTAS: Operation = op(
    "dedicatedInferences_get_quotas",
    Method::GET,
    "/v2/dedicated-inferences/quotas",
);
const SIZES: Operation = op(
    "dedicatedInferences_list_sizes",
    Method::GET,
    "/v2/dedicated-inferences/sizes",
);
const GET: Operation = op(
    "dedicatedInferences_get",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}",
);
const DELETE: Operation = op(
    "dedicatedInferences_delete",
    Method::DELETE,
    "/v2/dedicated-inferences/{dedicated_inference_id}",
);
const PATCH: Operation = op(
    "dedicatedInferences_patch",
    Method::PATCH,
    "/v2/dedicated-inferences/{dedicated_inference_id}",
);
const ACCELERATORS: Operation = op(
    "dedicatedInferences_list_accelerators",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators",
);
const ACCELERATOR: Operation = op(
    "dedicatedInferences_get_accelerator",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators/{accelerator_id}",
);
const CA: Operation = op(
    "dedicatedInferences_get_ca",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}/ca",
);
const EVENTS: Operation = op(
    "dedicatedInferences_list_events",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}/events",
);
const TOKENS: Operation = op(
    "dedicatedInferences_list_tokens",
    Method::GET,
    "/v2/dedicated-inferences/{dedicated_inference_id}/tokens",
);
const TOKEN_CREATE: Operation = op(
    "dedicatedInferences_create_tokens",
    Method::POST,
    "/v2/dedicated-inferences/{dedicated_inference_id}/tokens",
);
const TOKEN_REVOKE: Operation = op(
    "dedicatedInferences_delete_tokens",
    Method::DELETE,
    "/v2/dedicated-inferences/{dedicated_inference_id}/tokens/{token_id}",
);

/// Every operation the client has a method for.
#[cfg(test)]
const OPERATIONS: [&Operation; 15] = [
    &LIST,
    &CREATE,
    &GPU_MODEL_CONFIG,
    &QUOTAS,
    &SIZES,
    &GET,
    &DELETE,
    &PATCH,
    &ACCELERATORS,
    &ACCELERATOR,
    &CA,
    &EVENTS,
    &TOKENS,
    &TOKEN_CREATE,
    &TOKEN_REVOKE,
];

const NO_QUERY: Option<&()> = None;
const NO_BODY: Option<&()> = None;

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::operations::{documented, listed};
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Every operation of the public API's document has its method here, with the method and
    /// path the document gives, and the client has no operation the document lacks.
    #[test]
    fn the_operations_are_the_documents() {
        let doc: Value =
            serde_json::from_str(include_str!("../../../openapi/public.json")).unwrap();
        assert_eq!(listed(&OPERATIONS), documented(&doc));
    }

    #[test]
    fn ids_fill_the_path_as_they_read() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        assert_eq!(
            TOKEN_REVOKE.path_with(&[&Id::from(a), &Id::from(b)]),
            format!("/v2/dedicated-inferences/{a}/tokens/{b}")
        );
    }

    #[test]
    fn ids_cannot_change_the_path() {
        assert!(Id::parse("../sizes").is_err());
        assert!(Id::parse("a/b").is_err());
        assert!(Id::parse("a?b").is_err());
        assert!(Id::parse("a%2Fb").is_err());
        assert!(Id::parse("").is_err());
        assert!(Id::parse("7e5c619c-359c-44ca-87e2-47e98170c012").is_ok());
    }

    /// What the fake API was sent: the request line and the Idempotency-Key.
    type Sent = Arc<Mutex<Vec<(String, Option<String>)>>>;

    /// An API on a local port that answers each request with the next of `answers` (status and
    /// body; `Retry-After: 0`, so a retry after 503 does not wait) and records what it was sent.
    async fn fake_api(answers: Vec<(u16, String)>) -> (Client, Sent) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let sent: Sent = Arc::default();
        let record = sent.clone();
        tokio::spawn(async move {
            for (status, body) in answers {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // The requests under test have no body: the head is the whole request.
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = socket.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    request.extend_from_slice(&buf[..n]);
                }
                let head = String::from_utf8_lossy(&request).into_owned();
                let line = head.lines().next().unwrap().to_string();
                let key = head.lines().find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("idempotency-key: ")
                        .map(str::to_owned)
                });
                record.lock().unwrap().push((line, key));
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\nretry-after: 0\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                socket.write_all(answer.as_bytes()).await.unwrap();
                socket.shutdown().await.unwrap();
            }
        });
        (Client::new(&base, "dia_v1_test".into()).unwrap(), sent)
    }

    #[tokio::test]
    async fn a_write_keeps_its_key_through_retries_and_the_next_write_has_another() {
        let answers = [(503, ""), (204, ""), (202, ""), (200, "{")];
        let (client, sent) = fake_api(answers.map(|(s, b)| (s, b.to_string())).into()).await;
        let (di, token) = (Id::from(Uuid::new_v4()), Id::from(Uuid::new_v4()));
        let revoked = client.token_revoke(&di, &token).await.unwrap();
        assert_eq!(revoked.raw, "");
        client.delete(&di).await.unwrap();
        let not_json = client.get(&di).await.err().unwrap();
        assert!(
            matches!(&not_json, Failure::Api { status: 200, id, .. } if id == "invalid_response"),
            "{not_json:?}"
        );
        let sent = sent.lock().unwrap().clone();
        let lines: Vec<&str> = sent.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(
            lines,
            [
                format!(
                    "DELETE /v2/dedicated-inferences/{}/tokens/{} HTTP/1.1",
                    di.0, token.0
                ),
                format!(
                    "DELETE /v2/dedicated-inferences/{}/tokens/{} HTTP/1.1",
                    di.0, token.0
                ),
                format!("DELETE /v2/dedicated-inferences/{} HTTP/1.1", di.0),
                format!("GET /v2/dedicated-inferences/{} HTTP/1.1", di.0),
            ]
        );
        let keys: Vec<Option<&str>> = sent.iter().map(|(_, k)| k.as_deref()).collect();
        assert!(keys[0].is_some());
        assert_eq!(keys[0], keys[1], "a retry sends the same key");
        assert!(
            keys[2].is_some() && keys[2] != keys[0],
            "a new write, a new key"
        );
        assert_eq!(keys[3], None, "a read has no key");
    }

    #[tokio::test]
    async fn answers_are_checked_against_the_document_and_kept_as_sent() {
        let sizes = r#"{"enabled_regions": ["atl1"], "sizes": [], "newer_field": 1}"#;
        let (client, _) = fake_api(vec![
            (200, sizes.to_string()),
            (200, r#"{"dedicated_inference": {}}"#.to_string()),
        ])
        .await;
        let answer = client.sizes().await.unwrap();
        assert_eq!(answer.raw, sizes, "--output json prints the text as sent");
        assert_eq!(answer.typed.enabled_regions, ["atl1"]);
        assert_eq!(answer.body["newer_field"], 1);
        let wrong = client.get(&Id::from(Uuid::new_v4())).await.err().unwrap();
        assert!(
            matches!(&wrong, Failure::Api { status: 200, id, message, .. }
                if id == "invalid_response" && message.contains("dedicatedInferences_get")),
            "{wrong:?}"
        );
    }

    #[tokio::test]
    async fn lists_send_their_filters_and_follow_pages() {
        let token = json!({"id": Uuid::new_v4(), "name": "t", "is_managed": false,
                           "created_at": "2026-01-01T00:00:00Z"});
        let page = |n: usize| {
            json!({"tokens": vec![token.clone(); n], "links": {"pages": {}}, "meta": {"total": 3}})
                .to_string()
        };
        let none =
            json!({"dedicated_inferences": [], "links": {"pages": {}}, "meta": {"total": 0}});
        let (mut client, sent) = fake_api(vec![
            (200, none.to_string()),
            (200, page(2)),
            (200, page(1)),
        ])
        .await;
        client.per_page = 2;
        let filter = ListFilter {
            region: Some("nyc2".into()),
            name: Some("a b".into()),
        };
        let (listed, total) = client
            .every_page(|page| client.list(&filter, page))
            .await
            .unwrap();
        assert_eq!((listed.len(), total), (0, 0));
        let id = Id::from(Uuid::new_v4());
        let (tokens, total) = client
            .every_page(|page| client.tokens(&id, page))
            .await
            .unwrap();
        assert_eq!((tokens.len(), total), (3, 3));
        let sent = sent.lock().unwrap().clone();
        let lines: Vec<&str> = sent.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(
            lines,
            [
                "GET /v2/dedicated-inferences?region=nyc2&name=a+b&page=1&per_page=2 HTTP/1.1"
                    .to_string(),
                format!(
                    "GET /v2/dedicated-inferences/{}/tokens?page=1&per_page=2 HTTP/1.1",
                    id.0
                ),
                format!(
                    "GET /v2/dedicated-inferences/{}/tokens?page=2&per_page=2 HTTP/1.1",
                    id.0
                ),
            ]
        );
    }
}

//! The simulated Hub over real HTTP: each answer the Hub gives (status, `X-Error-Code`,
//! `X-Error-Message`, body) for the requests a control plane makes, and the `/_sim` admin API.

use std::net::SocketAddr;

use hub_sim::{Gated, HubFaults, HubSim, Repo, SEED_READER_TOKEN};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const QWEN: &str = "Qwen/Qwen2.5-7B-Instruct";
const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn start() -> HubSim {
    HubSim::start(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("start hub-sim")
}

struct Answer {
    status: StatusCode,
    code: Option<String>,
    message: Option<String>,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The Hub's error shape: this status and code, the message in header and body alike.
    fn assert_error(&self, status: u16, code: Option<&str>) {
        assert_eq!(self.status.as_u16(), status, "{:?}", self.message);
        assert_eq!(self.code.as_deref(), code);
        let message = self.message.clone().expect("X-Error-Message");
        assert_eq!(self.json(), json!({ "error": message }));
    }
}

async fn call(sim: &HubSim, method: Method, path: &str, token: Option<&str>) -> Answer {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let mut req = client.request(method, format!("{}{path}", sim.url()));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("request");
    let headers = resp.headers().clone();
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    Answer {
        status: resp.status(),
        code: text("x-error-code"),
        message: text("x-error-message"),
        body: resp.bytes().await.expect("body").to_vec(),
        headers,
    }
}

async fn get(sim: &HubSim, path: &str, token: Option<&str>) -> Answer {
    call(sim, Method::GET, path, token).await
}

async fn admin(sim: &HubSim, method: Method, path: &str, body: Value) -> (StatusCode, Value) {
    let resp = reqwest::Client::new()
        .request(method, format!("{}{path}", sim.url()))
        .json(&body)
        .send()
        .await
        .expect("admin request");
    let status = resp.status();
    let bytes = resp.bytes().await.unwrap();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (status, v)
}

const INVALID: &str = "Invalid credentials in Authorization header";

#[tokio::test]
async fn whoami_knows_valid_tokens_only() {
    let sim = start().await;
    let ok = get(&sim, "/api/whoami-v2", Some(SEED_READER_TOKEN)).await;
    assert_eq!(ok.status, StatusCode::OK);
    let v = ok.json();
    assert_eq!(v["type"], "user");
    assert_eq!(v["name"], "sim-reader");
    assert_eq!(v["auth"]["accessToken"]["role"], "read");
    assert!(v["auth"]["accessToken"]["displayName"].is_string());

    for token in [Some("hf_unknown"), None, Some("")] {
        let no = get(&sim, "/api/whoami-v2", token).await;
        no.assert_error(401, None);
        assert_eq!(no.message.as_deref(), Some(INVALID));
    }

    sim.add_token("hf_alice", "alice").unwrap();
    let alice = get(&sim, "/api/whoami-v2", Some("hf_alice")).await;
    assert_eq!(alice.json()["name"], "alice");
    assert!(sim.revoke_token("hf_alice"));
    get(&sim, "/api/whoami-v2", Some("hf_alice"))
        .await
        .assert_error(401, None);
}

#[tokio::test]
async fn public_model_info_has_the_hub_fields() {
    let sim = start().await;
    let a = get(&sim, &format!("/api/models/{QWEN}"), None).await;
    assert_eq!(a.status, StatusCode::OK);
    let v = a.json();
    assert_eq!(v["id"], QWEN);
    assert_eq!(v["modelId"], QWEN);
    assert_eq!(v["author"], "Qwen");
    assert!(v["_id"].as_str().is_some_and(|s| s.len() == 24));
    let sha = v["sha"].as_str().unwrap();
    assert!(hub_sim::is_sha(sha), "{sha}");
    assert_eq!(sha, sim.repo(QWEN).unwrap().sha());
    assert!(v["lastModified"].as_str().unwrap().ends_with('Z'));
    assert_eq!(v["private"], false);
    assert_eq!(v["disabled"], false);
    assert_eq!(v["gated"], false);
    assert_eq!(v["pipeline_tag"], "text-generation");
    assert_eq!(v["library_name"], "transformers");
    assert!(v["tags"].as_array().unwrap().contains(&json!("qwen2")));
    assert_eq!(
        v["config"],
        json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    );
    assert_eq!(
        v["safetensors"],
        json!({"parameters": {"BF16": 7_615_616_512u64}, "total": 7_615_616_512u64})
    );
    let files: Vec<&str> = v["siblings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["rfilename"].as_str().unwrap())
        .collect();
    assert!(files.contains(&"config.json"));
    assert!(files.contains(&"model-00004-of-00004.safetensors"));

    // Ids are looked up whatever their case; the answer names the repository as it is.
    let lower = get(&sim, "/api/models/qwen/qwen2.5-7b-instruct", None).await;
    assert_eq!(lower.json()["id"], QWEN);

    // A valid token changes nothing for a public repository; an invalid one is refused.
    let with = get(
        &sim,
        &format!("/api/models/{QWEN}"),
        Some(SEED_READER_TOKEN),
    )
    .await;
    assert_eq!(with.json(), v);
    let bad = get(&sim, &format!("/api/models/{QWEN}"), Some("hf_revoked")).await;
    bad.assert_error(401, None);
    assert_eq!(bad.message.as_deref(), Some(INVALID));
}

#[tokio::test]
async fn missing_and_private_repositories_are_not_found() {
    let sim = start().await;
    sim.add_token("hf_owner", "owner").unwrap();
    sim.add_token("hf_stranger", "stranger").unwrap();
    sim.publish(
        Repo::model(
            "acme/secret-7b",
            "LlamaForCausalLM",
            7_000_000_000,
            32,
            4096,
            32,
            8,
            8192,
        )
        .private()
        .owned_by("hf_owner"),
    )
    .unwrap();

    for path in [
        "/api/models/nobody/nothing",
        "/api/models/acme/secret-7b",
        "/acme/secret-7b/resolve/main/config.json",
        "/nobody/nothing/resolve/main/config.json",
    ] {
        // Anonymous: 401; authenticated: 404. Both RepoNotFound, as the Hub answers.
        let anon = get(&sim, path, None).await;
        anon.assert_error(401, Some("RepoNotFound"));
        assert_eq!(anon.message.as_deref(), Some("Repository not found"));
        get(&sim, path, Some("hf_stranger"))
            .await
            .assert_error(404, Some("RepoNotFound"));
    }

    let owner = get(&sim, "/api/models/acme/secret-7b", Some("hf_owner")).await;
    assert_eq!(owner.status, StatusCode::OK);
    assert_eq!(owner.json()["private"], true);
    let file = get(
        &sim,
        "/acme/secret-7b/resolve/main/config.json",
        Some("hf_owner"),
    )
    .await;
    assert_eq!(file.status, StatusCode::OK);

    sim.grant("acme/secret-7b", "hf_stranger").unwrap();
    let granted = get(&sim, "/api/models/acme/secret-7b", Some("hf_stranger")).await;
    assert_eq!(granted.status, StatusCode::OK);

    // Removed: gone for everyone.
    assert!(sim.remove("acme/secret-7b"));
    get(&sim, "/api/models/acme/secret-7b", Some("hf_owner"))
        .await
        .assert_error(404, Some("RepoNotFound"));
    get(&sim, "/api/models/acme/secret-7b", None)
        .await
        .assert_error(401, Some("RepoNotFound"));
}

#[tokio::test]
async fn gated_info_is_public_but_files_need_access() {
    let sim = start().await;
    sim.add_token("hf_nobody", "nobody").unwrap();
    let info = get(&sim, &format!("/api/models/{LLAMA}"), None).await;
    assert_eq!(info.status, StatusCode::OK);
    assert_eq!(info.json()["gated"], "manual");
    assert_eq!(
        info.json()["config"]["architectures"],
        json!(["LlamaForCausalLM"])
    );
    let mistral = get(&sim, "/api/models/mistralai/Mistral-7B-Instruct-v0.3", None).await;
    assert_eq!(mistral.json()["gated"], "auto");

    let path = format!("/{LLAMA}/resolve/main/config.json");
    let anon = get(&sim, &path, None).await;
    anon.assert_error(401, Some("GatedRepo"));
    assert_eq!(
        anon.message.as_deref(),
        Some(
            "Access to model meta-llama/Llama-3.1-8B-Instruct is restricted. You must have \
             access to it and be authenticated to access it. Please log in."
        )
    );
    let stranger = get(&sim, &path, Some("hf_nobody")).await;
    stranger.assert_error(403, Some("GatedRepo"));
    assert_eq!(
        stranger.message.as_deref(),
        Some(
            "Access to model meta-llama/Llama-3.1-8B-Instruct is restricted and you are not in \
             the authorized list. Visit https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct \
             to ask for access."
        )
    );
    let head = call(&sim, Method::HEAD, &path, Some("hf_nobody")).await;
    assert_eq!(head.status, StatusCode::FORBIDDEN);
    assert_eq!(head.code.as_deref(), Some("GatedRepo"));

    let reader = get(&sim, &path, Some(SEED_READER_TOKEN)).await;
    assert_eq!(reader.status, StatusCode::OK);
    assert_eq!(reader.json()["num_key_value_heads"], 8);

    sim.grant(LLAMA, "hf_nobody").unwrap();
    assert_eq!(
        get(&sim, &path, Some("hf_nobody")).await.status,
        StatusCode::OK
    );

    // Ungating opens the files to everyone; gating closes them again.
    sim.set_gated(QWEN, Gated::Auto).unwrap();
    get(&sim, &format!("/{QWEN}/resolve/main/config.json"), None)
        .await
        .assert_error(401, Some("GatedRepo"));
    sim.set_gated(QWEN, Gated::No).unwrap();
    assert_eq!(
        get(&sim, &format!("/{QWEN}/resolve/main/config.json"), None)
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn resolve_serves_config_and_files_with_hub_headers() {
    let sim = start().await;
    let sha = sim.repo(QWEN).unwrap().sha().to_string();
    let path = format!("/{QWEN}/resolve/main/config.json");
    let got = get(&sim, &path, None).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.header("x-repo-commit"), Some(sha.as_str()));
    let etag = got.header("etag").unwrap().to_string();
    assert!(etag.starts_with('"') && etag.ends_with('"'), "{etag}");
    assert_eq!(
        got.header("content-length"),
        Some(got.body.len().to_string().as_str())
    );
    let config = got.json();
    assert_eq!(config, sim.repo(QWEN).unwrap().config);
    assert_eq!(config["hidden_size"], 3584);
    assert_eq!(config["num_hidden_layers"], 28);
    assert_eq!(config["num_attention_heads"], 28);
    assert_eq!(config["num_key_value_heads"], 4);
    assert_eq!(config["max_position_embeddings"], 32768);
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(config["vocab_size"], 152064);

    // HEAD: the same headers, no body.
    let head = call(&sim, Method::HEAD, &path, None).await;
    assert_eq!(head.status, StatusCode::OK);
    assert!(head.body.is_empty());
    assert_eq!(head.header("etag"), Some(etag.as_str()));
    assert_eq!(head.header("x-repo-commit"), Some(sha.as_str()));
    assert_eq!(
        head.header("content-length"),
        Some(got.body.len().to_string().as_str())
    );

    // Other files are small placeholders.
    let shard = get(
        &sim,
        &format!("/{QWEN}/resolve/main/model-00001-of-00004.safetensors"),
        None,
    )
    .await;
    assert_eq!(shard.status, StatusCode::OK);
    assert!(!shard.body.is_empty() && shard.body.len() < 1024);

    get(&sim, &format!("/{QWEN}/resolve/main/nope.bin"), None)
        .await
        .assert_error(404, Some("EntryNotFound"));
    get(&sim, &format!("/{QWEN}/resolve/nope/config.json"), None)
        .await
        .assert_error(404, Some("RevisionNotFound"));

    // The wrong case is redirected to the repository's own id.
    let moved = get(
        &sim,
        "/qwen/qwen2.5-7b-instruct/resolve/main/config.json",
        None,
    )
    .await;
    assert_eq!(moved.status, StatusCode::TEMPORARY_REDIRECT);
    assert_eq!(moved.header("location"), Some(path.as_str()));

    // Invalid credentials first, whatever the rest.
    get(&sim, &path, Some("hf_bogus"))
        .await
        .assert_error(401, None);

    // A repository without config.json.
    let mut bare = Repo {
        id: "acme/bare".into(),
        files: vec!["README.md".into()],
        ..Repo::default()
    };
    bare = sim.publish(bare).unwrap();
    assert!(!bare.files.contains(&"config.json".to_string()));
    get(&sim, "/acme/bare/resolve/main/config.json", None)
        .await
        .assert_error(404, Some("EntryNotFound"));
    let info = get(&sim, "/api/models/acme/bare", None).await.json();
    assert!(info.get("config").is_none() && info.get("safetensors").is_none());
}

#[tokio::test]
async fn revisions_have_their_own_sha_and_config() {
    let sim = start().await;
    let main_sha = sim.repo(QWEN).unwrap().sha().to_string();
    let mut dev_config = sim.repo(QWEN).unwrap().config;
    dev_config["max_position_embeddings"] = json!(131072);
    let dev_sha = sim
        .push_revision(QWEN, "long-context", Some(dev_config))
        .unwrap();
    assert_ne!(dev_sha, main_sha);

    let at = get(
        &sim,
        &format!("/api/models/{QWEN}/revision/long-context"),
        None,
    )
    .await;
    assert_eq!(at.json()["sha"], dev_sha);
    let main = get(&sim, &format!("/api/models/{QWEN}/revision/main"), None).await;
    assert_eq!(main.json()["sha"], main_sha);
    // By commit sha too.
    let by_sha = get(
        &sim,
        &format!("/api/models/{QWEN}/revision/{dev_sha}"),
        None,
    )
    .await;
    assert_eq!(by_sha.json()["sha"], dev_sha);

    let cfg = get(
        &sim,
        &format!("/{QWEN}/resolve/long-context/config.json"),
        None,
    )
    .await;
    assert_eq!(cfg.header("x-repo-commit"), Some(dev_sha.as_str()));
    assert_eq!(cfg.json()["max_position_embeddings"], 131072);
    let cfg_main = get(&sim, &format!("/{QWEN}/resolve/main/config.json"), None).await;
    assert_eq!(cfg_main.json()["max_position_embeddings"], 32768);

    let missing = get(&sim, &format!("/api/models/{QWEN}/revision/v9"), None).await;
    missing.assert_error(404, Some("RevisionNotFound"));
    assert_eq!(missing.message.as_deref(), Some("Invalid rev id: v9"));
    let unknown_sha = "0".repeat(40);
    get(
        &sim,
        &format!("/api/models/{QWEN}/revision/{unknown_sha}"),
        None,
    )
    .await
    .assert_error(404, Some("RevisionNotFound"));

    // Moving main keeps the commit it left readable by sha.
    let new_main = sim.push_revision(QWEN, "main", None).unwrap();
    assert_eq!(sim.repo(QWEN).unwrap().sha(), new_main);
    let old = get(
        &sim,
        &format!("/{QWEN}/resolve/{main_sha}/config.json"),
        None,
    )
    .await;
    assert_eq!(old.status, StatusCode::OK);
    assert_eq!(old.header("x-repo-commit"), Some(main_sha.as_str()));

    // So does moving any other branch, with the config the commit had: a deployment pinned to
    // it still loads.
    let moved = sim.push_revision(QWEN, "long-context", None).unwrap();
    assert_ne!(moved, dev_sha);
    let at = get(
        &sim,
        &format!("/api/models/{QWEN}/revision/long-context"),
        None,
    )
    .await;
    assert_eq!(at.json()["sha"], moved);
    let left = get(
        &sim,
        &format!("/{QWEN}/resolve/{dev_sha}/config.json"),
        None,
    )
    .await;
    assert_eq!(left.status, StatusCode::OK);
    assert_eq!(left.header("x-repo-commit"), Some(dev_sha.as_str()));
    assert_eq!(left.json()["max_position_embeddings"], 131072);
}

#[tokio::test]
async fn seeds_are_the_catalog_models() {
    let sim = start().await;
    let expect = [
        (QWEN, "Qwen2ForCausalLM", json!(false)),
        (LLAMA, "LlamaForCausalLM", json!("manual")),
        (
            "meta-llama/Llama-3.3-70B-Instruct",
            "LlamaForCausalLM",
            json!("manual"),
        ),
        (
            "mistralai/Mistral-7B-Instruct-v0.3",
            "MistralForCausalLM",
            json!("auto"),
        ),
        (
            "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
            "LlamaForCausalLM",
            json!(false),
        ),
        ("openai/gpt-oss-20b", "GptOssForCausalLM", json!(false)),
        ("openai/gpt-oss-120b", "GptOssForCausalLM", json!(false)),
    ];
    for (id, arch, gated) in expect {
        let v = get(&sim, &format!("/api/models/{id}"), None).await.json();
        assert_eq!(v["config"]["architectures"], json!([arch]), "{id}");
        assert_eq!(v["gated"], gated, "{id}");
        // The reader token reads every one of them.
        let cfg = get(
            &sim,
            &format!("/{id}/resolve/main/config.json"),
            Some(SEED_READER_TOKEN),
        )
        .await;
        assert_eq!(cfg.status, StatusCode::OK, "{id}");
    }
    let oss = get(&sim, "/api/models/openai/gpt-oss-20b", None)
        .await
        .json();
    assert_eq!(oss["safetensors"]["total"], 21_511_953_984u64);
    let cfg = get(&sim, "/openai/gpt-oss-20b/resolve/main/config.json", None)
        .await
        .json();
    assert_eq!(cfg["head_dim"], 64);
    assert_eq!(cfg["num_local_experts"], 32);
}

#[tokio::test]
async fn admin_api_drives_the_same_state() {
    let sim = HubSim::start_empty(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let (s, ids) = admin(&sim, Method::GET, "/_sim/repos", Value::Null).await;
    assert_eq!((s, ids), (StatusCode::OK, json!([])));

    let (s, repo) = admin(
        &sim,
        Method::POST,
        "/_sim/models",
        json!({"id": "acme/tiny-1b", "architecture": "LlamaForCausalLM", "params": 1_235_814_400u64,
               "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8,
               "max_position_embeddings": 131072, "gated": "manual"}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{repo}");
    assert_eq!(repo["gated"], "manual");
    assert!(hub_sim::is_sha(repo["revisions"]["main"].as_str().unwrap()));

    let (s, _) = admin(
        &sim,
        Method::POST,
        "/_sim/tokens",
        json!({"token": "hf_bob", "user": "bob"}),
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let cfg = "/acme/tiny-1b/resolve/main/config.json";
    get(&sim, cfg, Some("hf_bob"))
        .await
        .assert_error(403, Some("GatedRepo"));
    let (s, repo) = admin(
        &sim,
        Method::POST,
        "/_sim/repos/acme/tiny-1b/grants",
        json!({"token": "hf_bob"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(repo["granted"], json!(["hf_bob"]));
    assert_eq!(get(&sim, cfg, Some("hf_bob")).await.status, StatusCode::OK);

    let (_, repo) = admin(
        &sim,
        Method::PUT,
        "/_sim/repos/acme/tiny-1b/gated",
        json!({"gated": false}),
    )
    .await;
    assert_eq!(repo["gated"], false);
    assert_eq!(get(&sim, cfg, None).await.status, StatusCode::OK);
    let (s, _) = admin(
        &sim,
        Method::PUT,
        "/_sim/repos/acme/tiny-1b/gated",
        json!({"gated": "often"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let (_, repo) = admin(
        &sim,
        Method::PUT,
        "/_sim/repos/acme/tiny-1b/private",
        json!({"private": true}),
    )
    .await;
    assert_eq!(repo["private"], true);
    get(&sim, "/api/models/acme/tiny-1b", None)
        .await
        .assert_error(401, Some("RepoNotFound"));
    assert_eq!(
        get(&sim, "/api/models/acme/tiny-1b", Some("hf_bob"))
            .await
            .status,
        StatusCode::OK
    );

    let (s, rev) = admin(
        &sim,
        Method::POST,
        "/_sim/repos/acme/tiny-1b/revisions",
        json!({"name": "dev", "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    let at = get(
        &sim,
        "/api/models/acme/tiny-1b/revision/dev",
        Some("hf_bob"),
    )
    .await
    .json();
    assert_eq!(at["sha"], rev["sha"]);

    // A full repository body: only the id is needed.
    let (s, full) = admin(
        &sim,
        Method::POST,
        "/_sim/repos",
        json!({"id": "acme/raw", "config": {"architectures": ["X"], "model_type": "x"},
               "safetensors": {"F16": 10}, "files": ["README.md"]}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{full}");
    assert_eq!(full["files"], json!(["README.md", "config.json"]));
    let (s, _) = admin(&sim, Method::POST, "/_sim/repos", json!({"id": "no-slash"})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (_, shown) = admin(&sim, Method::GET, "/_sim/repos/ACME/RAW", Value::Null).await;
    assert_eq!(shown["id"], "acme/raw");

    let (s, _) = admin(
        &sim,
        Method::POST,
        "/_sim/tokens/revoke",
        json!({"token": "hf_bob"}),
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    get(&sim, "/api/whoami-v2", Some("hf_bob"))
        .await
        .assert_error(401, None);

    let (s, _) = admin(&sim, Method::DELETE, "/_sim/repos/acme/raw", Value::Null).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    get(&sim, "/api/models/acme/raw", None)
        .await
        .assert_error(401, Some("RepoNotFound"));
    let (s, _) = admin(&sim, Method::DELETE, "/_sim/repos/acme/raw", Value::Null).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn faults_refuse_hub_requests_not_admin_ones() {
    let sim = start().await;
    let path = format!("/api/models/{QWEN}");
    let (s, _) = admin(&sim, Method::PUT, "/_sim/faults", json!({"fail_next": 2})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        get(&sim, &path, None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Admin requests neither count nor fail.
    let (s, _) = admin(&sim, Method::GET, "/_sim/repos", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        get(&sim, &path, None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(get(&sim, &path, None).await.status, StatusCode::OK);
    assert_eq!(sim.faults().fail_next, 0);

    sim.set_faults(HubFaults {
        rate_limit_rate: 1.0,
        retry_after_secs: 7,
        ..Default::default()
    });
    let limited = get(&sim, "/api/whoami-v2", None).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.header("retry-after"), Some("7"));
    sim.set_faults(HubFaults {
        error_rate: 1.0,
        ..Default::default()
    });
    let broken = get(&sim, &format!("/{QWEN}/resolve/main/config.json"), None).await;
    assert_eq!(broken.status, StatusCode::INTERNAL_SERVER_ERROR);
    sim.set_faults(HubFaults::default());

    let (_, stats) = admin(&sim, Method::GET, "/_sim/stats", Value::Null).await;
    assert_eq!(stats["requests"], 5);
    assert_eq!(stats["faults_injected"], 4);
    assert_eq!(
        stats["by_kind"],
        json!({"model_info": 3, "whoami": 1, "resolve": 1})
    );
    assert_eq!(sim.stats().requests, 5);
    sim.shutdown().await;
}

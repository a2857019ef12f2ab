//! `HubClient` against the simulated Hugging Face Hub over HTTP: tokens, public, private and
//! gated repositories, revisions, removed repositories, and transient failures retried.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use cloud_clients::hugging_face::Gated;
use cloud_clients::{HubClient, HubClientOptions, HubError, RetryConfig};
use common::errors::{Classify, ErrorClass};
use hub_sim::{HubFaults, HubSim, Repo, SEED_READER_TOKEN};
use serde_json::json;

const QWEN: &str = "Qwen/Qwen2.5-7B-Instruct";
const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";
const MISTRAL: &str = "mistralai/Mistral-7B-Instruct-v0.3";

fn fast_retry(max_attempts: usize) -> RetryConfig {
    RetryConfig {
        min_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(20),
        max_attempts,
        max_elapsed: Duration::from_secs(5),
        max_retry_after: Duration::from_secs(2),
        jitter: true,
    }
}

fn client(url: &str, retry: RetryConfig) -> HubClient {
    HubClient::with_options(
        url,
        HubClientOptions {
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            retry,
        },
    )
    .expect("client")
}

async fn start() -> (HubSim, HubClient) {
    let sim = HubSim::start(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("start hub-sim");
    let hub = client(&sim.url(), fast_retry(5));
    (sim, hub)
}

#[tokio::test]
async fn whoami_tells_valid_tokens_from_invalid_ones() {
    let (sim, hub) = start().await;
    assert_eq!(
        hub.whoami(SEED_READER_TOKEN).await.unwrap().name,
        "sim-reader"
    );
    for bad in ["hf_never_issued", "", "  "] {
        let e = hub.whoami(bad).await.unwrap_err();
        assert_eq!(e, HubError::InvalidToken, "{bad:?}");
        assert_eq!(e.class(), ErrorClass::Refused);
    }
    sim.add_token("hf_alice", "alice").unwrap();
    assert_eq!(hub.whoami("hf_alice").await.unwrap().name, "alice");
    sim.revoke_token("hf_alice");
    assert_eq!(
        hub.whoami("hf_alice").await.unwrap_err(),
        HubError::InvalidToken
    );
    // An invalid token is refused on every call, public repositories included.
    assert_eq!(
        hub.model_info(QWEN, None, Some("hf_alice"))
            .await
            .unwrap_err(),
        HubError::InvalidToken
    );
    assert_eq!(
        hub.model_config(QWEN, None, Some("hf_alice"))
            .await
            .unwrap_err(),
        HubError::InvalidToken
    );
}

#[tokio::test]
async fn public_repo_info_and_config() {
    let (sim, hub) = start().await;
    let info = hub.model_info(QWEN, None, None).await.unwrap();
    assert_eq!(info.id, QWEN);
    assert_eq!(info.sha, sim.repo(QWEN).unwrap().sha());
    assert!(!info.private);
    assert_eq!(info.gated, Gated::No);
    assert_eq!(info.architectures, vec!["Qwen2ForCausalLM".to_string()]);
    assert_eq!(info.model_type.as_deref(), Some("qwen2"));
    assert_eq!(
        info.safetensors_parameters,
        BTreeMap::from([("BF16".to_string(), 7_615_616_512)])
    );

    let oss = hub
        .model_info("openai/gpt-oss-20b", None, None)
        .await
        .unwrap();
    assert_eq!(oss.architectures, vec!["GptOssForCausalLM".to_string()]);
    assert_eq!(oss.safetensors_parameters.len(), 2);
    assert_eq!(oss.parameters_total(), 21_511_953_984);

    let config = hub.model_config(QWEN, None, None).await.unwrap();
    assert_eq!(config["num_key_value_heads"], 4);
    assert_eq!(config["hidden_size"], 3584);
    assert_eq!(config["max_position_embeddings"], 32768);

    // Asked in another case: the Hub's own spelling comes back, and resolve's redirect is
    // followed.
    let lower = hub
        .model_info("qwen/qwen2.5-7b-instruct", None, None)
        .await
        .unwrap();
    assert_eq!(lower.id, QWEN);
    assert_eq!(
        hub.model_config("qwen/qwen2.5-7b-instruct", None, None)
            .await
            .unwrap(),
        config
    );

    // No safetensors, no config.json.
    sim.publish(Repo {
        id: "acme/bare".into(),
        files: vec!["README.md".into()],
        ..Repo::default()
    })
    .unwrap();
    let bare = hub.model_info("acme/bare", None, None).await.unwrap();
    assert!(bare.safetensors_parameters.is_empty() && bare.architectures.is_empty());
    assert_eq!(bare.model_type, None);
    assert_eq!(
        hub.model_config("acme/bare", None, None).await.unwrap_err(),
        HubError::EntryNotFound
    );
}

#[tokio::test]
async fn private_repo_needs_a_token_that_reads_it() {
    let (sim, hub) = start().await;
    sim.add_token("hf_owner", "owner").unwrap();
    sim.add_token("hf_stranger", "stranger").unwrap();
    sim.publish(
        Repo::model(
            "acme/secret-7b",
            "MistralForCausalLM",
            7_241_732_096,
            32,
            4096,
            32,
            8,
            32768,
        )
        .private()
        .owned_by("hf_owner"),
    )
    .unwrap();
    for token in [None, Some("hf_stranger")] {
        assert_eq!(
            hub.model_info("acme/secret-7b", None, token)
                .await
                .unwrap_err(),
            HubError::RepoNotFound,
            "{token:?}"
        );
        assert_eq!(
            hub.model_config("acme/secret-7b", None, token)
                .await
                .unwrap_err(),
            HubError::RepoNotFound,
            "{token:?}"
        );
    }
    let info = hub
        .model_info("acme/secret-7b", None, Some("hf_owner"))
        .await
        .unwrap();
    assert!(info.private);
    assert_eq!(info.model_type.as_deref(), Some("mistral"));
    let config = hub
        .model_config("acme/secret-7b", None, Some("hf_owner"))
        .await
        .unwrap();
    assert_eq!(config["num_hidden_layers"], 32);
}

#[tokio::test]
async fn gated_repo_info_is_open_its_config_is_not() {
    let (sim, hub) = start().await;
    sim.add_token("hf_stranger", "stranger").unwrap();
    let info = hub.model_info(LLAMA, None, None).await.unwrap();
    assert_eq!(info.gated, Gated::Manual);
    assert!(info.gated.is_gated());
    assert_eq!(info.parameters_total(), 8_030_261_248);
    assert_eq!(
        hub.model_info(MISTRAL, None, None).await.unwrap().gated,
        Gated::Auto
    );

    let no_token = hub.model_config(LLAMA, None, None).await.unwrap_err();
    assert_eq!(no_token, HubError::GatedNoAccess { with_token: false });
    assert_eq!(no_token.class(), ErrorClass::Refused);
    assert_eq!(
        hub.model_config(LLAMA, None, Some("hf_stranger"))
            .await
            .unwrap_err(),
        HubError::GatedNoAccess { with_token: true }
    );
    let granted = hub
        .model_config(LLAMA, None, Some(SEED_READER_TOKEN))
        .await
        .unwrap();
    assert_eq!(granted["num_key_value_heads"], 8);
    assert_eq!(granted["max_position_embeddings"], 131072);

    sim.grant(LLAMA, "hf_stranger").unwrap();
    assert!(hub
        .model_config(LLAMA, None, Some("hf_stranger"))
        .await
        .is_ok());
}

#[tokio::test]
async fn revisions_are_looked_up() {
    let (sim, hub) = start().await;
    let main_sha = sim.repo(QWEN).unwrap().sha().to_string();
    let mut long = sim.repo(QWEN).unwrap().config;
    long["max_position_embeddings"] = json!(131072);
    let dev_sha = sim.push_revision(QWEN, "long-context", Some(long)).unwrap();
    // A branch name with slashes travels as one path segment.
    let pr_sha = sim.push_revision(QWEN, "refs/pr/1", None).unwrap();

    let main = hub.model_info(QWEN, Some("main"), None).await.unwrap();
    assert_eq!(main.sha, main_sha);
    let dev = hub
        .model_info(QWEN, Some("long-context"), None)
        .await
        .unwrap();
    assert_eq!(dev.sha, dev_sha);
    assert_ne!(dev.sha, main.sha);
    assert_eq!(
        hub.model_info(QWEN, Some("refs/pr/1"), None)
            .await
            .unwrap()
            .sha,
        pr_sha
    );
    assert_eq!(
        hub.model_info(QWEN, Some(&dev_sha), None)
            .await
            .unwrap()
            .sha,
        dev_sha
    );
    let dev_config = hub
        .model_config(QWEN, Some("long-context"), None)
        .await
        .unwrap();
    assert_eq!(dev_config["max_position_embeddings"], 131072);
    let main_config = hub.model_config(QWEN, None, None).await.unwrap();
    assert_eq!(main_config["max_position_embeddings"], 32768);

    for rev in ["v9", "0000000000000000000000000000000000000000"] {
        assert_eq!(
            hub.model_info(QWEN, Some(rev), None).await.unwrap_err(),
            HubError::RevisionNotFound
        );
        assert_eq!(
            hub.model_config(QWEN, Some(rev), None).await.unwrap_err(),
            HubError::RevisionNotFound
        );
    }
}

#[tokio::test]
async fn removed_and_impossible_repos_are_not_found() {
    let (sim, hub) = start().await;
    assert!(hub.model_info(QWEN, None, None).await.is_ok());
    assert!(sim.remove(QWEN));
    for token in [None, Some(SEED_READER_TOKEN)] {
        assert_eq!(
            hub.model_info(QWEN, None, token).await.unwrap_err(),
            HubError::RepoNotFound
        );
        assert_eq!(
            hub.model_config(QWEN, None, token).await.unwrap_err(),
            HubError::RepoNotFound
        );
    }
    // An id that cannot name a repository is not asked about.
    let before = sim.stats().requests;
    for bad in ["gpt2", "a/b/c", "../etc/passwd", "a/b?x=1"] {
        assert_eq!(
            hub.model_info(bad, None, None).await.unwrap_err(),
            HubError::RepoNotFound
        );
    }
    assert_eq!(sim.stats().requests, before);
}

#[tokio::test]
async fn transient_failures_are_retried_then_returned() {
    let (sim, hub) = start().await;
    // Two 503s, then the answer.
    sim.set_faults(HubFaults {
        fail_next: 2,
        ..Default::default()
    });
    let before = sim.stats().requests;
    let info = hub.model_info(QWEN, None, None).await.unwrap();
    assert_eq!(info.id, QWEN);
    assert_eq!(sim.stats().requests - before, 3);
    assert_eq!(sim.stats().faults_injected, 2);

    // Down for longer than the retries last: transient, after every attempt.
    let three = client(&sim.url(), fast_retry(3));
    sim.set_faults(HubFaults {
        error_rate: 1.0,
        ..Default::default()
    });
    let before = sim.stats().requests;
    let e = three.model_config(QWEN, None, None).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::TRANSIENT, "{e:?}");
    assert!(
        matches!(&e, HubError::Transient { message, .. } if message.contains("500")),
        "{e}"
    );
    assert_eq!(sim.stats().requests - before, 3);

    // A 429 whose Retry-After is longer than the policy waits: returned at once, transient.
    sim.set_faults(HubFaults {
        rate_limit_rate: 1.0,
        retry_after_secs: 30,
        ..Default::default()
    });
    let before = sim.stats().requests;
    let e = three.whoami(SEED_READER_TOKEN).await.unwrap_err();
    assert_eq!(
        e.class(),
        ErrorClass::Transient {
            retry_after: Some(Duration::from_secs(30))
        },
        "{e:?}"
    );
    assert_eq!(sim.stats().requests - before, 1);
    sim.set_faults(HubFaults::default());
    assert!(three.whoami(SEED_READER_TOKEN).await.is_ok());

    // Nobody listening: transient too.
    let addr = sim.addr();
    sim.shutdown().await;
    let gone = client(&format!("http://{addr}"), fast_retry(2));
    let e = gone.model_info(QWEN, None, None).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::TRANSIENT, "{e:?}");
}

#[tokio::test]
async fn errors_never_carry_the_token() {
    let (sim, hub) = start().await;
    sim.add_token("hf_stranger_secret", "stranger").unwrap();
    let token = "hf_stranger_secret";
    let e = hub
        .model_config(LLAMA, None, Some(token))
        .await
        .unwrap_err();
    assert!(!format!("{e} {e:?} {hub:?}").contains("secret"));
    let e = hub.whoami("hf_unknown_secret").await.unwrap_err();
    assert!(!format!("{e} {e:?}").contains("secret"));
}

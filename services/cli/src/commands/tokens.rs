//! The endpoint's access tokens: list, create (the value shown once) and revoke.

use serde_json::json;

use super::{print_json, print_raw};
use crate::client::{Client, Id};
use crate::render::{self, s};
use crate::{Failure, Output, TokensCommand};

pub(crate) async fn tokens(
    client: &Client,
    out: Output,
    command: TokensCommand,
) -> Result<(), Failure> {
    match command {
        TokensCommand::List { id } => {
            let id = &Id::parse(&id)?;
            let (items, total) = client
                .every_page(move |page| client.tokens(id, page))
                .await?;
            match out {
                Output::Json => print_json(&json!({
                    "tokens": items, "links": {"pages": {}}, "meta": {"total": total}
                })),
                Output::Text => {
                    let rows: Vec<Vec<String>> = items
                        .iter()
                        .map(|t| {
                            vec![
                                s(&t["id"]),
                                s(&t["name"]),
                                s(&t["is_managed"]),
                                render::time(&t["created_at"]),
                            ]
                        })
                        .collect();
                    print!(
                        "{}",
                        render::table(&["ID", "NAME", "MANAGED", "CREATED"], &rows)
                    );
                }
            }
        }
        TokensCommand::Create { id, name } => {
            let answer = client.token_create(&Id::parse(&id)?, &name).await?;
            match out {
                Output::Json => print_raw(&answer),
                Output::Text => {
                    let t = &answer.body["token"];
                    println!(
                        "Created token {} ({}), shown only this once; store it now:",
                        s(&t["name"]),
                        s(&t["id"])
                    );
                    println!("  {}", s(&t["value"]));
                }
            }
        }
        TokensCommand::Delete { id, token_id } => {
            let di_id = Id::parse(&id)?;
            let answer = client.token_revoke(&di_id, &Id::parse(&token_id)?).await?;
            match out {
                Output::Json => print_raw(&answer),
                Output::Text => println!("Revoked token {token_id}."),
            }
        }
    }
    Ok(())
}

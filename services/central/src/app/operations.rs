//! Keyed operations on an existing DI (PATCH, DELETE, token create and revoke): each is recorded
//! under its idempotency key, sent to the owning region by one driver at a time, and its answer
//! replayed to a retry.

use super::*;

impl App {
    /// Runs `operation`; under an Idempotency-Key at most once: a stored response is replayed, a
    /// reused key with another body refused, and otherwise the key's operation (this one, or the
    /// one a first request stored and did not finish) is driven to its end in a task of its own,
    /// so that a client that disconnects cannot cut it off half-way.
    async fn idempotent(
        &self,
        key: Option<&str>,
        fp: Vec<u8>,
        operation: Operation,
    ) -> Result<Reply, ApiError> {
        let Some(key) = key else {
            return Ok(self.run_operation(&operation).await?);
        };
        let team_id = operation.team_id;
        let own = self.sealer.seal(
            &serde_json::to_vec(&operation).expect("operations serialise"),
            operation_aad(team_id, key).as_bytes(),
        );
        // Claims the key for this request's operation, or reads what it stands for.
        let begin = || {
            self.store.idempotency_begin(
                team_id,
                key,
                &fp,
                Some(KeyedOperation {
                    di_id: operation.di_id,
                    sealed: &own,
                }),
            )
        };
        let mut state = begin().await?;
        // A retry while another attempt of the operation is in flight (recovery's, after the
        // first one's answer was lost) waits for it and replays its answer: clients do not
        // retry a 409. Should that attempt change nothing (the key is released), the retry
        // claims the key again and runs its own; should it run past the retry's patience, the
        // retry is answered 503, which clients retry.
        let give_up = tokio::time::Instant::now() + self.drive_lease;
        loop {
            let sealed = match state {
                IdempotencyState::Fresh => own.clone(),
                IdempotencyState::Unfinished {
                    sealed_operation: Some(first),
                    ..
                } => first,
                IdempotencyState::Done {
                    status_code,
                    sealed_body,
                } => return self.replay(team_id, status_code, &sealed_body),
                IdempotencyState::Mismatch => return Err(key_mismatch()),
                // The DI is gone: what this request would get now.
                IdempotencyState::Erased { .. } => return Err(ApiError::NotFound),
                IdempotencyState::Unfinished {
                    sealed_operation: None,
                    ..
                } => return Err(key_in_progress()),
            };
            let (app, owned_key) = (self.clone(), key.to_owned());
            let drive = async move { app.try_drive_operation(team_id, &owned_key, &sealed).await };
            let driven = tokio::spawn(drive.instrument(tracing::Span::current()))
                .await
                .map_err(ApiError::internal)?;
            match driven {
                Some(reply) => return reply,
                None if tokio::time::Instant::now() >= give_up => return Err(busy()),
                None => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    state = begin().await?;
                }
            }
        }
    }

    /// Drives a keyed operation to its end: its response is stored for the key, or the key is
    /// released when the operation changed nothing. While its outcome is unknown (the region was
    /// unreachable or slow) the key keeps it, for a retry or recovery to drive again.
    pub async fn drive_operation(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Result<Reply, ApiError> {
        self.try_drive_operation(team_id, key, sealed)
            .await
            .unwrap_or_else(|| Err(key_in_progress()))
    }

    /// As [`App::drive_operation`]; `None` while another attempt of the operation is in flight
    /// (one at a time, as for a create: see `drive_create`).
    async fn try_drive_operation(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Option<Result<Reply, ApiError>> {
        match self
            .store
            .operation_drive_begin(team_id, key, self.drive_lease)
            .await
        {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(Err(e.into())),
        }
        let driven = self.drive_operation_once(team_id, key, sealed).await;
        if let Err(e) = self.store.operation_drive_end(team_id, key).await {
            tracing::warn!(%team_id, error = %e, "giving an operation's drive back failed; it lapses");
        }
        Some(driven)
    }

    async fn drive_operation_once(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Result<Reply, ApiError> {
        let operation: Operation = match self.open_intent(sealed, &operation_aad(team_id, key)) {
            Ok(operation) => operation,
            Err(problem) => {
                tracing::warn!(%team_id, "a keyed operation {problem}; releasing its key");
                self.store.idempotency_release(team_id, key).await?;
                return Err(ApiError::internal(format!("keyed operation {problem}")));
            }
        };
        match self.run_operation(&operation).await {
            Ok(reply) => {
                let sealed = self
                    .sealer
                    .seal(&reply.body, response_aad(team_id).as_bytes());
                self.store
                    .idempotency_complete(team_id, key, reply.status.as_u16(), &sealed)
                    .await?;
                Ok(reply)
            }
            Err(OperationError::Refused(e)) => {
                self.store.idempotency_release(team_id, key).await?;
                Err(e)
            }
            Err(OperationError::Unsettled(e)) => Err(e),
        }
    }

    /// Sends an operation to its region and answers with the public reply.
    async fn run_operation(&self, op: &Operation) -> Result<Reply, OperationError> {
        let scoped = |operation_id: &Uuid| TeamScoped {
            team_id: op.team_id,
            operation_id: Some(*operation_id),
        };
        match &op.kind {
            OperationKind::Patch(request) => self.run_patch(op, request).await,
            OperationKind::Delete { operation_id } => {
                let answer = self
                    .regions
                    .delete(&op.region, op.di_id, &scoped(operation_id))
                    .await
                    .map_err(region_failure)?;
                self.apply(&answer.record)
                    .await
                    .map_err(OperationError::Unsettled)?;
                Ok(Reply::empty(StatusCode::ACCEPTED))
            }
            OperationKind::TokenCreate {
                request,
                token_value,
            } => {
                let token = self
                    .regions
                    .token_create(&op.region, op.di_id, request)
                    .await
                    .map_err(region_failure)?;
                let mut public = AccessToken::from(&token);
                public.value = Some(token_value.clone());
                Ok(Reply::json(
                    StatusCode::ACCEPTED,
                    &TokenEnvelope { token: public },
                ))
            }
            OperationKind::TokenRevoke {
                token_id,
                operation_id,
            } => {
                self.regions
                    .token_revoke(&op.region, op.di_id, *token_id, &scoped(operation_id))
                    .await
                    .map_err(region_failure)?;
                Ok(Reply::empty(StatusCode::NO_CONTENT))
            }
        }
    }

    /// A patch that renames the DI reserves the new name in central before the region call, and
    /// gives it back if the call fails (should the patch have landed after all, the change feed
    /// renames again).
    async fn run_patch(
        &self,
        op: &Operation,
        request: &regional::PatchRequest,
    ) -> Result<Reply, OperationError> {
        let current = self
            .store
            .dedicated_inference(op.di_id, op.team_id)
            .await
            .map_err(store_failure)?
            .ok_or(OperationError::Refused(ApiError::NotFound))?;
        let new_name = request
            .spec
            .as_ref()
            .map(|s| s.name.as_str())
            .filter(|n| *n != current.name);
        if let Some(name) = new_name {
            self.store
                .rename(op.di_id, op.team_id, name)
                .await
                .map_err(store_failure)?;
        }
        let answer = self.regions.patch(&op.region, op.di_id, request).await;
        match answer {
            Ok(RecordEnvelope { record }) => {
                let public = self
                    .apply(&record)
                    .await
                    .map_err(OperationError::Unsettled)?;
                Ok(Reply::json(
                    StatusCode::ACCEPTED,
                    &DedicatedInferenceEnvelope {
                        dedicated_inference: public,
                    },
                ))
            }
            Err(e) => {
                if new_name.is_some() {
                    let _ = self.store.rename(op.di_id, op.team_id, &current.name).await;
                }
                Err(region_failure(e))
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Writes to an existing DI

    pub async fn patch(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
        parsed: Parsed<UpdateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:update")?;
        let owned = self.owned(p, id).await?;
        let req = parsed.value;
        let checked = req
            .spec
            .as_ref()
            .map(|s| validate::spec(&self.catalog, s))
            .transpose()?;
        let tokens = req.access_tokens.as_ref().or(req.secrets.as_ref());
        let hf = tokens
            .and_then(|t| t.hugging_face_token.as_deref())
            .map(check_provider_token)
            .transpose()?;
        if checked.is_none() && hf.is_none() {
            return Err(ApiError::Unprocessable(
                "The request must contain spec and/or access_tokens.".into(),
            ));
        }
        let fp = fingerprint(
            "PATCH",
            &format!("/v2/dedicated-inferences/{id}"),
            &parsed.canonical,
        );
        let request = regional::PatchRequest {
            team_id: p.team_id,
            operation_id: Some(Uuid::new_v4()),
            requires_hugging_face_token: checked.as_ref().is_some_and(|c| c.gated),
            spec: checked.map(|c| c.spec),
            hugging_face_token: hf,
        };
        let operation = Operation::new(p, &owned, OperationKind::Patch(request));
        self.idempotent(key, fp, operation).await
    }

    pub async fn delete(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:delete")?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint("DELETE", &format!("/v2/dedicated-inferences/{id}"), "");
        let kind = OperationKind::Delete {
            operation_id: Uuid::new_v4(),
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }

    pub async fn token_create(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
        parsed: Parsed<TokenCreateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:create")?;
        validate::name("name", &parsed.value.name)?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint(
            "POST",
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &parsed.canonical,
        );
        let token_value = common::tokens::mint(common::tokens::ENDPOINT_TOKEN_PREFIX);
        let request = regional::TokenCreateRequest {
            team_id: p.team_id,
            operation_id: Some(Uuid::new_v4()),
            token: NewToken {
                id: Uuid::new_v4(),
                name: parsed.value.name,
                sha256_hex: common::tokens::sha256_hex(&token_value),
            },
        };
        let kind = OperationKind::TokenCreate {
            request,
            token_value,
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }

    pub async fn token_revoke(
        &self,
        p: &Principal,
        id: Uuid,
        token_id: Uuid,
        key: Option<&str>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:delete")?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint(
            "DELETE",
            &format!("/v2/dedicated-inferences/{id}/tokens/{token_id}"),
            "",
        );
        let kind = OperationKind::TokenRevoke {
            token_id,
            operation_id: Uuid::new_v4(),
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }
}

//! Creates: a create is stored in central with its intent sealed, then driven to its region by
//! one driver at a time; a retried create (with or without a key) finds it and replays its answer.

use super::*;

impl App {
    pub async fn create(
        &self,
        p: &Principal,
        key: Option<&str>,
        parsed: Parsed<CreateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:create")?;
        let req = parsed.value;
        let checked = validate::spec(&self.catalog, &req.spec)?;
        let hf = provider_token(req.access_tokens.as_ref().or(req.secrets.as_ref()))?;
        if checked.gated && hf.is_none() {
            return Err(ApiError::Unprocessable(
                "access_tokens.hugging_face_token is required: the model is gated on Hugging Face."
                    .into(),
            ));
        }
        let fp = fingerprint("POST", "/v2/dedicated-inferences", &parsed.canonical);
        let di_id = Uuid::new_v4();
        let token_value = common::tokens::mint(common::tokens::ENDPOINT_TOKEN_PREFIX);
        let mut spec = checked.spec;
        spec.version = 1;
        let intent = CreateIntent {
            request: regional::CreateRequest {
                id: di_id,
                team_id: p.team_id,
                spec,
                hugging_face_token: hf,
                managed_token: NewToken {
                    id: Uuid::new_v4(),
                    name: MANAGED_TOKEN_NAME.into(),
                    sha256_hex: common::tokens::sha256_hex(&token_value),
                },
            },
            token_value,
        };
        let sealed = self.sealer.seal(
            &serde_json::to_vec(&intent).expect("intent serialises"),
            intent_aad(di_id).as_bytes(),
        );
        // A retry of this very request may find the create it repeats refused meanwhile (its
        // first attempt was answered "changed nothing" while this one waited for it): the
        // name is free again, and this request then starts afresh, once.
        for afresh in [false, true] {
            let begun = self
                .store
                .create_begin(&NewCreate {
                    di_id,
                    team_id: p.team_id,
                    region: &intent.request.spec.region,
                    name: &intent.request.spec.name,
                    fingerprint: &fp,
                    sealed_intent: &sealed,
                    idempotency_key: key,
                })
                .await;
            let repeated = match begun {
                Ok(CreateBegin::Started) => {
                    return self
                        .drive_create(di_id, p.team_id, self.drive_lease, busy)
                        .await
                }
                Ok(CreateBegin::KeyTaken) => match self
                    .store
                    .idempotency_state(p.team_id, key.unwrap_or_default(), &fp)
                    .await?
                {
                    IdempotencyState::Done {
                        status_code,
                        sealed_body,
                    } => return self.replay(p.team_id, status_code, &sealed_body),
                    IdempotencyState::Mismatch => return Err(key_mismatch()),
                    IdempotencyState::Erased { .. } => {
                        return Err(ApiError::Conflict(
                            "The dedicated inference this request created has been deleted \
                             since; send a new request to create another."
                                .into(),
                        ))
                    }
                    // Past the retry's patience its first attempt may still run (another driver
                    // took the drive as it lapsed): 503, which clients retry, not 409.
                    IdempotencyState::Unfinished {
                        di_id: Some(id), ..
                    } => (
                        id,
                        self.drive_create(id, p.team_id, self.drive_lease, busy)
                            .await,
                    ),
                    // The create the key stood for was refused in between: start afresh.
                    IdempotencyState::Fresh if !afresh => continue,
                    IdempotencyState::Fresh => return Err(busy()),
                    IdempotencyState::Unfinished { di_id: None, .. } => {
                        return Err(key_in_progress())
                    }
                },
                Err(StoreError::NameTaken) => {
                    // The same request again, from a client that may never have got the answer
                    // (a timeout, a 503 that recovery then settled): finish that create, or
                    // replay its response with the token, rather than refuse the retry.
                    match self
                        .store
                        .create_by_fingerprint(
                            p.team_id,
                            &intent.request.spec.name,
                            &fp,
                            REPLAY_WINDOW,
                        )
                        .await?
                    {
                        Some(id) => (
                            id,
                            self.drive_create(id, p.team_id, self.drive_lease, busy)
                                .await,
                        ),
                        None => return Err(StoreError::NameTaken.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            };
            match repeated {
                (id, Err(_)) if !afresh && self.store.create_state(id).await?.is_none() => continue,
                (_, driven) => return driven,
            }
        }
        unreachable!("the second round returns")
    }

    /// Settles a create and answers with its response. A pending create is sent to its region
    /// (idempotent there) and confirmed with the region's view, or aborted when the region
    /// refuses it or its intent cannot be read; a settled one replays its first response. Used by
    /// the request path, by retries, and by recovery after a crash.
    /// Sends pending create `di_id` to its region and settles it, or answers with how it was
    /// settled. While another driver is sending it, waits up to `patience` for that attempt to
    /// end, then answers `busy`.
    pub async fn drive_create(
        &self,
        di_id: Uuid,
        team_id: Uuid,
        patience: Duration,
        busy: impl FnOnce() -> ApiError,
    ) -> Result<Reply, ApiError> {
        // One attempt at a time (a request, a retry, recovery, on any replica): the region's
        // "changed nothing" settles the create only because no other attempt of it can be in
        // flight and land after it (found by the soak: recovery's attempt landed while the
        // request's was told nothing changed, and the retry then found its name taken).
        let give_up = tokio::time::Instant::now() + patience;
        while !self
            .store
            .create_drive_begin(di_id, self.drive_lease)
            .await?
        {
            // Settled (its answer is replayed, nothing is sent), or being sent right now.
            if !matches!(
                self.store.create_state(di_id).await?,
                Some(CreateState::Pending { .. })
            ) {
                return self.drive_create_once(di_id, team_id).await;
            }
            if tokio::time::Instant::now() >= give_up {
                return Err(busy());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A task of its own: a client that goes away does not cut the attempt, or the giving
        // back of the drive, short (that would hold other drivers off until it lapses).
        let app = self.clone();
        let drive = async move {
            let driven = app.drive_create_once(di_id, team_id).await;
            if let Err(e) = app.store.create_drive_end(di_id).await {
                tracing::warn!(%di_id, error = %e, "giving a create's drive back failed; it lapses");
            }
            driven
        };
        tokio::spawn(drive.instrument(tracing::Span::current()))
            .await
            .map_err(ApiError::internal)?
    }

    async fn drive_create_once(&self, di_id: Uuid, team_id: Uuid) -> Result<Reply, ApiError> {
        let sealed = match self.store.create_state(di_id).await? {
            Some(CreateState::Pending {
                team_id: owner,
                sealed_intent,
            }) if owner == team_id => sealed_intent,
            Some(CreateState::Settled {
                team_id: owner,
                status_code,
                sealed_response,
            }) if owner == team_id => return self.replay(team_id, status_code, &sealed_response),
            Some(_) => return Err(ApiError::NotFound),
            None => {
                return Err(ApiError::Conflict(
                    "The create this request repeats was refused meanwhile; send it again.".into(),
                ))
            }
        };
        let intent: CreateIntent = match self.open_intent(&sealed, &intent_aad(di_id)) {
            Ok(intent) => intent,
            Err(problem) => {
                // Nothing can ever send it: settle it as failed rather than retry it forever.
                tracing::warn!(%di_id, "a pending create's intent {problem}; settling it as failed");
                self.store.create_abort(di_id).await?;
                return Err(ApiError::internal(format!("create intent {problem}")));
            }
        };
        let answer = self
            .regions
            .create(&intent.request.spec.region, &intent.request)
            .await;
        match answer {
            Ok(RecordEnvelope { record }) => {
                let public = DedicatedInference::from_record(&record)
                    .ok_or_else(|| ApiError::internal("region returned a DI without spec"))?;
                let body = CreateResponse {
                    token: AccessToken {
                        id: intent.request.managed_token.id,
                        name: intent.request.managed_token.name.clone(),
                        value: Some(intent.token_value.clone()),
                        created_at: record.created_at,
                        is_managed: true,
                    },
                    dedicated_inference: public,
                };
                let reply = Reply::json(StatusCode::ACCEPTED, &body);
                let body_value =
                    serde_json::to_value(&body.dedicated_inference).expect("serialises");
                let update = read_model_update(&record, &body.dedicated_inference, &body_value);
                let sealed_reply = self
                    .sealer
                    .seal(&reply.body, response_aad(team_id).as_bytes());
                self.store
                    .create_confirm(&update, reply.status.as_u16(), &sealed_reply)
                    .await?;
                Ok(reply)
            }
            Err(RegionCallError::Rejected { status, error }) if (400..500).contains(&status) => {
                self.store.create_abort(di_id).await?;
                Err(region_error(RegionCallError::Rejected { status, error }))
            }
            // Nothing was stored: the create is over (the customer's retry starts afresh), not
            // one for recovery to finish behind a 503.
            Err(e @ RegionCallError::NotApplied(_)) => {
                self.store.create_abort(di_id).await?;
                Err(region_error(e))
            }
            Err(e) => Err(region_error(e)),
        }
    }
}

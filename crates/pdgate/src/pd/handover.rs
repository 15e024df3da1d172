//! The decode's first frame while a concurrent prefill may still run: until then nothing has
//! reached the client, so a failure can still be retried.

use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;

use crate::endpoints::Endpoint;
use crate::engine::EngineBody;
use crate::engine::client;
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::pd::relay::PartnerResult;

/// What came first while a concurrent prefill was still running: the decode's first frame, or
/// the prefill's end.
#[derive(Debug)]
pub(crate) enum FirstByte {
    /// The decode's first frame (`None`: its body was empty); the prefill still runs.
    Frame(Option<Frame<Bytes>>),
    /// The prefill succeeded first, reporting these cached prompt tokens.
    PrefillDone(Option<u32>),
    /// The prefill failed first: nothing reached the client, a retry is safe.
    PrefillFailed(GatewayError),
    /// The decode broke or stayed silent past `idle`.
    DecodeFailed(GatewayError),
}

/// Waits for the decode's first frame or the prefill's end, whichever comes first.
pub(crate) async fn first_byte(
    body: &mut EngineBody,
    prefill: &mut AbortOnDropHandle<PartnerResult>,
    idle: Duration,
    decode: &Endpoint,
) -> FirstByte {
    tokio::select! {
        biased;
        done = prefill => match done {
            Ok(Ok(cached)) => FirstByte::PrefillDone(cached),
            Ok(Err(e)) => FirstByte::PrefillFailed(e),
            Err(join) => FirstByte::PrefillFailed(GatewayError::Internal(format!("prefill task ended: {join}"))),
        },
        frame = next_frame(body, idle, decode) => match frame {
            Ok(frame) => FirstByte::Frame(frame),
            Err(e) => FirstByte::DecodeFailed(e),
        },
    }
}

/// The decode's next frame within `idle` (`None`: its body ended).
pub(crate) async fn next_frame(
    body: &mut EngineBody,
    idle: Duration,
    decode: &Endpoint,
) -> Result<Option<Frame<Bytes>>, GatewayError> {
    match timeout(idle, body.frame()).await {
        Ok(None) => Ok(None),
        Ok(Some(Ok(frame))) => Ok(Some(frame)),
        Ok(Some(Err(e))) => Err(client::upstream(
            Leg::Decode,
            decode.target(),
            UpstreamKind::Broken,
            format!("broke the response stream: {e}"),
        )),
        Err(_) => Err(client::upstream(
            Leg::Decode,
            decode.target(),
            UpstreamKind::Silent,
            format!("sent nothing for {idle:?}"),
        )),
    }
}

//! A body that tells a guard how it ended: the one wrapper behind the admission slot (released at
//! the end), the SGLang abort (disarmed at a clean end) and the engine connection (back to its
//! pool after a clean end, and driven before each read).

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;

/// What a [`GuardedBody`] holds until its body ends.
pub trait OnEnd: Send + 'static {
    /// The body ended: `clean` after its last frame, not after an error. May be called more than
    /// once (a sized body's last frame, then the end); dropping the guard is the other way out.
    fn ended(&mut self, clean: bool);

    /// Runs before each poll of the body (nothing by default).
    fn before_poll(&mut self, _cx: &mut Context<'_>) {}
}

pin_project! {
    /// `inner`, with `guard` told when it ends.
    #[derive(Debug)]
    pub struct GuardedBody<B, G> {
        #[pin]
        inner: B,
        guard: G,
    }
}

impl<B, G> GuardedBody<B, G> {
    /// `inner` guarded by `guard`.
    pub fn new(inner: B, guard: G) -> Self {
        GuardedBody { inner, guard }
    }
}

impl<G: OnEnd> GuardedBody<Body, G> {
    /// Wraps `inner` into a body again.
    pub fn wrap(inner: Body, guard: G) -> Body {
        Body::new(GuardedBody { inner, guard })
    }
}

impl<B: http_body::Body<Data = Bytes>, G: OnEnd> http_body::Body for GuardedBody<B, G> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        this.guard.before_poll(cx);
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.guard.ended(true),
            // A sized body can end with its last frame (hyper then polls no more).
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.guard.ended(true),
            Poll::Ready(Some(Err(_))) => this.guard.ended(false),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

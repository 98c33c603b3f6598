//! Actions: one step of work for one stage, and their text form.
//!
//! The text form is PyTorch's `_Action.__repr__` / `_Action.from_str`:
//! `[stage][kind][microbatch]` (`0F1`, `1SEND_F0`, `1UNSHARD`), or
//! `(sub;sub;...)KIND` for a compound action such as
//! `(0F3;3B1)OVERLAP_F_B`. Parsing is stricter than PyTorch's: trailing
//! text, a missing microbatch on a per-microbatch kind, or a microbatch on a
//! per-stage kind are errors rather than silently ignored.

use std::fmt;
use std::str::FromStr;

/// What an action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// `F`: forward of one microbatch.
    Forward,
    /// `B`: full backward (inputs and weights) of one microbatch.
    FullBackward,
    /// `I`: backward for the stage's inputs only.
    BackwardInput,
    /// `W`: backward for the stage's weights only.
    BackwardWeight,
    /// `SEND_F`: send a forward activation to the next stage.
    SendF,
    /// `RECV_F`: receive a forward activation from the previous stage.
    RecvF,
    /// `SEND_B`: send an input gradient to the previous stage.
    SendB,
    /// `RECV_B`: receive an output gradient from the next stage.
    RecvB,
    /// `UNSHARD`: gather the stage's sharded parameters.
    Unshard,
    /// `RESHARD`: free the gathered parameters again.
    Reshard,
    /// `REDUCE_GRAD`: reduce the stage's gradients across data parallelism.
    ReduceGrad,
    /// `OVERLAP_F_B`: a forward and a backward run overlapped (compound).
    OverlapFB,
}

impl ActionKind {
    /// Every kind, in PyTorch's declaration order.
    pub const ALL: [ActionKind; 12] = [
        ActionKind::Forward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::Unshard,
        ActionKind::Reshard,
        ActionKind::SendF,
        ActionKind::RecvF,
        ActionKind::SendB,
        ActionKind::RecvB,
        ActionKind::FullBackward,
        ActionKind::OverlapFB,
        ActionKind::ReduceGrad,
    ];

    /// The kind's text, as PyTorch writes it (`F`, `SEND_F`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::FullBackward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendF => "SEND_F",
            ActionKind::RecvF => "RECV_F",
            ActionKind::SendB => "SEND_B",
            ActionKind::RecvB => "RECV_B",
            ActionKind::Unshard => "UNSHARD",
            ActionKind::Reshard => "RESHARD",
            ActionKind::ReduceGrad => "REDUCE_GRAD",
            ActionKind::OverlapFB => "OVERLAP_F_B",
        }
    }

    /// The kind whose text is exactly `text`, if any.
    pub fn from_text(text: &str) -> Option<ActionKind> {
        ActionKind::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// Whether this kind is computation (F, B, I, W, OVERLAP_F_B), as
    /// PyTorch's `is_compute_op`.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::FullBackward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
                | ActionKind::OverlapFB
        )
    }

    /// Whether this kind is a send or a receive.
    pub fn is_comm(self) -> bool {
        matches!(
            self,
            ActionKind::SendF | ActionKind::RecvF | ActionKind::SendB | ActionKind::RecvB
        )
    }

    /// Whether an action of this kind names a microbatch (true for compute
    /// and comm kinds, false for UNSHARD, RESHARD, REDUCE_GRAD and the
    /// compound OVERLAP_F_B).
    pub fn has_microbatch(self) -> bool {
        (self.is_compute() || self.is_comm()) && self != ActionKind::OverlapFB
    }

    /// Whether this kind is compound (made of sub-actions).
    pub fn is_compound(self) -> bool {
        self == ActionKind::OverlapFB
    }
}

impl fmt::Display for ActionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The largest stage number an [`Action`] can hold.
pub const MAX_STAGE: usize = u32::MAX as usize;

/// The largest microbatch number an [`Action`] can hold.
pub const MAX_MICROBATCH: usize = u32::MAX as usize - 1;

/// The stored microbatch of an action that names none.
const NO_MICROBATCH: u32 = u32::MAX;

/// One step of work: a stage, a kind, a microbatch where the kind has one,
/// and the sub-actions of a compound action.
///
/// Build actions with [`Action::new`], [`Action::per_stage`] and
/// [`Action::compound`]; they keep the invariants the text form needs
/// (a compound action's stage and microbatch come from its first
/// sub-action).
///
/// An action is small (16 bytes, and `Option<Action>` too) because
/// schedules and simulated timelines hold one per rank per step: stage
/// numbers go up to [`MAX_STAGE`] and microbatch numbers up to
/// [`MAX_MICROBATCH`] (parsing refuses larger ones with a
/// [`ParseActionError`]).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Action(Repr);

/// How an action is stored: a simple action inline; the sub-actions of a
/// compound one (rare) behind one thin pointer, so that simple actions,
/// the many, stay at 16 bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// Any action without sub-actions.
    Simple {
        stage: u32,
        /// The microbatch, or [`NO_MICROBATCH`].
        microbatch: u32,
        kind: ActionKind,
    },
    /// A compound action with at least one sub-action. Its stage is the
    /// first sub-action's and it names no microbatch, so neither is stored.
    Compound(Box<Compound>),
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Compound {
    kind: ActionKind,
    /// Never empty (an empty list makes a [`Repr::Simple`]).
    sub_actions: Vec<Action>,
}

impl Action {
    /// A simple action: `stage`, `kind`, and the microbatch (`None` for
    /// per-stage kinds such as UNSHARD).
    ///
    /// # Panics
    ///
    /// If `stage` is above [`MAX_STAGE`] or the microbatch above
    /// [`MAX_MICROBATCH`] (text input is checked by the parser instead,
    /// which returns an error).
    pub fn new(stage: usize, kind: ActionKind, microbatch: Option<usize>) -> Action {
        let stage = u32::try_from(stage)
            .unwrap_or_else(|_| panic!("stage {stage} is above the largest, {MAX_STAGE}"));
        let microbatch = match microbatch {
            None => NO_MICROBATCH,
            Some(mb) => u32::try_from(mb)
                .ok()
                .filter(|&m| m != NO_MICROBATCH)
                .unwrap_or_else(|| {
                    panic!("microbatch {mb} is above the largest, {MAX_MICROBATCH}")
                }),
        };
        Action(Repr::Simple {
            stage,
            microbatch,
            kind,
        })
    }

    /// The simple action of [`Action::simple_parts`]: `stage`, `kind` and
    /// the microbatch slot ([`Action::microbatch_slot`]).
    #[inline]
    pub(crate) fn from_parts(stage: usize, kind: ActionKind, microbatch_slot: usize) -> Action {
        let microbatch = (microbatch_slot as u32).wrapping_sub(1);
        match u32::try_from(stage) {
            Ok(stage) => Action(Repr::Simple {
                stage,
                microbatch,
                kind,
            }),
            Err(_) => Action::new(
                stage,
                kind,
                (microbatch != NO_MICROBATCH).then_some(microbatch as usize),
            ),
        }
    }

    /// A forward of `microbatch` on `stage`.
    pub fn forward(stage: usize, microbatch: usize) -> Action {
        Action::new(stage, ActionKind::Forward, Some(microbatch))
    }

    /// A per-stage action (UNSHARD, RESHARD, REDUCE_GRAD) on `stage`.
    pub fn per_stage(stage: usize, kind: ActionKind) -> Action {
        Action::new(stage, kind, None)
    }

    /// A compound action (`OVERLAP_F_B`) made of `sub_actions`.
    ///
    /// Its stage is the first sub-action's (0 if there is none), and it
    /// names no microbatch; only the sub-actions are printed.
    pub fn compound(kind: ActionKind, sub_actions: Vec<Action>) -> Action {
        if sub_actions.is_empty() {
            return Action(Repr::Simple {
                stage: 0,
                microbatch: NO_MICROBATCH,
                kind,
            });
        }
        Action(Repr::Compound(Box::new(Compound { kind, sub_actions })))
    }

    /// The stage this action runs on.
    #[inline]
    pub fn stage(&self) -> usize {
        match &self.0 {
            Repr::Simple { stage, .. } => *stage as usize,
            Repr::Compound(c) => c.sub_actions[0].stage(),
        }
    }

    /// The action's kind.
    #[inline]
    pub fn kind(&self) -> ActionKind {
        match &self.0 {
            Repr::Simple { kind, .. } => *kind,
            Repr::Compound(c) => c.kind,
        }
    }

    /// The microbatch, if the kind has one.
    #[inline]
    pub fn microbatch(&self) -> Option<usize> {
        match &self.0 {
            Repr::Simple { microbatch, .. } if *microbatch != NO_MICROBATCH => {
                Some(*microbatch as usize)
            }
            _ => None,
        }
    }

    /// The microbatch as a table index: 0 when the kind has none, else
    /// the microbatch + 1 (the simulators' flat tables).
    #[inline]
    pub(crate) fn microbatch_slot(&self) -> usize {
        match &self.0 {
            Repr::Simple { microbatch, .. } => microbatch.wrapping_add(1) as usize,
            Repr::Compound(_) => 0,
        }
    }

    /// The stage, kind and microbatch slot ([`Action::microbatch_slot`])
    /// of a simple action; `None` for a compound one (the hot loops read
    /// all three at once).
    #[inline]
    pub(crate) fn simple_parts(&self) -> Option<(usize, ActionKind, usize)> {
        match &self.0 {
            Repr::Simple {
                stage,
                microbatch,
                kind,
            } => Some((*stage as usize, *kind, microbatch.wrapping_add(1) as usize)),
            Repr::Compound(_) => None,
        }
    }

    /// The sub-actions of a compound action (empty for a simple one).
    #[inline]
    pub fn sub_actions(&self) -> &[Action] {
        match &self.0 {
            Repr::Simple { .. } => &[],
            Repr::Compound(c) => &c.sub_actions,
        }
    }

    /// Whether this is a compound action (printed with parentheses).
    pub fn is_compound(&self) -> bool {
        matches!(self.0, Repr::Compound(_)) || self.kind().is_compound()
    }
}

impl fmt::Debug for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Action")
            .field("stage", &self.stage())
            .field("kind", &self.kind())
            .field("microbatch", &self.microbatch())
            .field("sub_actions", &self.sub_actions())
            .finish()
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_compound() {
            f.write_str("(")?;
            for (i, sub) in self.sub_actions().iter().enumerate() {
                if i > 0 {
                    f.write_str(";")?;
                }
                write!(f, "{sub}")?;
            }
            return write!(f, "){}", self.kind());
        }
        write!(f, "{}{}", self.stage(), self.kind())?;
        if let Some(mb) = self.microbatch() {
            write!(f, "{mb}")?;
        }
        Ok(())
    }
}

/// Text that is not an action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid action {text:?}: {reason}; expected [stage][kind][microbatch] such as 2F0, 1UNSHARD or (0F3;3B1)OVERLAP_F_B")]
pub struct ParseActionError {
    /// The text that was parsed (trimmed).
    pub text: String,
    /// What was wrong with it.
    pub reason: String,
}

impl ParseActionError {
    fn new(text: &str, reason: impl Into<String>) -> ParseActionError {
        ParseActionError {
            text: text.to_owned(),
            reason: reason.into(),
        }
    }
}

impl Action {
    /// Parses an action, or an idle step: empty (or blank) text is `None`,
    /// as PyTorch's `_Action.from_str` returns `None` for it.
    pub fn parse_slot(text: &str) -> Result<Option<Action>, ParseActionError> {
        let text = text.trim();
        if text.is_empty() {
            Ok(None)
        } else {
            text.parse().map(Some)
        }
    }
}

impl FromStr for Action {
    type Err = ParseActionError;

    fn from_str(text: &str) -> Result<Action, ParseActionError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(ParseActionError::new(text, "it is empty"));
        }
        if let Some(rest) = text.strip_prefix('(') {
            return parse_compound(text, rest);
        }
        parse_simple(text)
    }
}

fn parse_compound(text: &str, rest: &str) -> Result<Action, ParseActionError> {
    let Some((inner, kind_text)) = rest.split_once(')') else {
        return Err(ParseActionError::new(text, "'(' is never closed by ')'"));
    };
    let kind = ActionKind::from_text(kind_text).ok_or_else(|| {
        ParseActionError::new(
            text,
            format!("{kind_text:?} after the sub-actions is not an action kind"),
        )
    })?;
    if !kind.is_compound() {
        return Err(ParseActionError::new(
            text,
            format!("{kind} is not a compound kind (only OVERLAP_F_B takes sub-actions)"),
        ));
    }
    let mut subs = Vec::new();
    for part in inner.split(';') {
        let part = part.trim();
        if part.is_empty() {
            return Err(ParseActionError::new(text, "a sub-action is empty"));
        }
        if part.starts_with('(') {
            return Err(ParseActionError::new(
                text,
                "sub-actions cannot be compound",
            ));
        }
        let sub = parse_simple(part).map_err(|e| {
            ParseActionError::new(text, format!("sub-action {part:?}: {}", e.reason))
        })?;
        subs.push(sub);
    }
    Ok(Action::compound(kind, subs))
}

fn parse_simple(text: &str) -> Result<Action, ParseActionError> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(ParseActionError::new(
            text,
            "it does not start with a stage number",
        ));
    }
    let (stage_text, rest) = text.split_at(digits);
    let stage = parse_number(text, stage_text, "stage", MAX_STAGE)?;
    let kind_len = rest.bytes().take_while(|b| !b.is_ascii_digit()).count();
    let (kind_text, mb_text) = rest.split_at(kind_len);
    let kind = ActionKind::from_text(kind_text).ok_or_else(|| {
        ParseActionError::new(text, format!("{kind_text:?} is not an action kind"))
    })?;
    if kind.is_compound() {
        return Err(ParseActionError::new(
            text,
            format!("{kind} needs sub-actions in parentheses"),
        ));
    }
    if !mb_text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseActionError::new(
            text,
            format!("{mb_text:?} after the kind is not a microbatch number"),
        ));
    }
    let microbatch = if mb_text.is_empty() {
        None
    } else {
        Some(parse_number(text, mb_text, "microbatch", MAX_MICROBATCH)?)
    };
    match (kind.has_microbatch(), microbatch) {
        (true, None) => Err(ParseActionError::new(
            text,
            format!("{kind} needs a microbatch number"),
        )),
        (false, Some(_)) => Err(ParseActionError::new(
            text,
            format!("{kind} takes no microbatch number"),
        )),
        _ => Ok(Action::new(stage, kind, microbatch)),
    }
}

fn parse_number(
    text: &str,
    digits: &str,
    what: &str,
    max: usize,
) -> Result<usize, ParseActionError> {
    digits.parse().ok().filter(|&n| n <= max).ok_or_else(|| {
        ParseActionError::new(
            text,
            format!("the {what} number {digits} is too large (at most {max})"),
        )
    })
}

//! # ferry-rpc-macros
//!
//! `#[derive(Schema)]` for `ferry_rpc::schema::Schema`: the structure of a
//! type as serde's data model sees it (struct and field names, variants,
//! field types, in order), a compile-time constant whose hash is what a
//! typed remote call carries for the callee's type check.
//!
//! Use it through `ferry_rpc` (which re-exports it), beside serde's derives:
//!
//! ```ignore
//! #[derive(serde::Serialize, serde::Deserialize, ferry_rpc::Schema)]
//! struct Point {
//!     x: i64,
//!     #[serde(rename = "y_coordinate")]
//!     y: i64,
//! }
//! ```
//!
//! The derive honours the serde attributes that change what serde writes:
//! `rename`, `rename_all`, `rename_all_fields`, `skip`,
//! `skip_serializing`, `skip_deserializing` and `transparent`. Those whose
//! output it cannot know (`with`, `serialize_with`, `deserialize_with`,
//! `from`, `into`, `try_from`) need `#[schema(as = Type)]` naming the type
//! serde writes instead; those that ferry's payload format (postcard)
//! cannot decode (`flatten`, `tag`, `untagged`, `skip_serializing_if`)
//! are refused with a compile error. The generated code names `ferry_rpc`
//! as the crate being compiled depends on it (directly, renamed, or through
//! the `ferry` facade as `ferry::rpc`); `#[schema(crate = path)]` names it
//! when it is reached another way.
//!
//! Recursive types derive too, directly (`struct Tree { children:
//! Vec<Tree> }`) or through one another (`enum A { B(Box<B>) }` with `enum
//! B { A(Option<Box<A>>) }`), through any container (`Vec`, `Option`,
//! `Box`, maps, `RRef`, ...). The shape of a type without generic
//! parameters is kept in a static, as `Shape::Declared`: where the type
//! comes back inside itself, its shape refers back to it and ends
//! (`Tree { children: [Tree] }`). A generic type has no static (it has one
//! shape per instantiation): where it contains itself, as `Self` or by its
//! name with its own parameters (`Tree<T>` in `struct Tree<T>`), the
//! shape says `Shape::Recursive(name)`, a reference to the nearest
//! enclosing type of that name (so the containers around that place must
//! not be types serde names the same); a generic type that reaches itself
//! only through other generic types, or with other parameters, still does
//! not compile (E0391). `transparent` and `as` types are their inner
//! type's shape, and cannot contain themselves.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{quote, ToTokens};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{Data, DeriveInput, Fields, GenericParam, LitStr};

/// Derives `ferry_rpc::schema::Schema` from a type's declaration and its
/// serde attributes (see the crate documentation).
#[proc_macro_derive(Schema, attributes(schema, serde))]
pub fn derive_schema(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// What the attributes of one item (container, field or variant) say.
#[derive(Default)]
struct Attrs {
    rename: Option<String>,
    rename_all: Option<String>,
    rename_all_fields: Option<String>,
    skip: bool,
    transparent: bool,
    /// `#[schema(as = T)]`: the type whose shape stands for this one.
    as_type: Option<syn::Type>,
    /// `#[schema(crate = path)]`.
    krate: Option<syn::Path>,
    /// A serde attribute whose output needs `#[schema(as = ..)]`.
    needs_as: Option<(String, proc_macro2::Span)>,
}

fn parse_attrs(attrs: &[syn::Attribute]) -> syn::Result<Attrs> {
    let mut out = Attrs::default();
    for attr in attrs {
        if attr.path().is_ident("serde") {
            attr.parse_nested_meta(|meta| {
                let key = meta
                    .path
                    .get_ident()
                    .map(|i| i.to_string())
                    .unwrap_or_default();
                match key.as_str() {
                    "rename" => out.rename = serialize_name(&meta)?.or(out.rename.take()),
                    "rename_all" => {
                        out.rename_all = serialize_name(&meta)?.or(out.rename_all.take())
                    }
                    "rename_all_fields" => {
                        out.rename_all_fields =
                            serialize_name(&meta)?.or(out.rename_all_fields.take())
                    }
                    "skip" | "skip_serializing" | "skip_deserializing" => out.skip = true,
                    "transparent" => out.transparent = true,
                    "flatten" | "tag" | "untagged" | "skip_serializing_if" | "remote" => {
                        return Err(meta.error(format!(
                            "#[derive(Schema)] does not support #[serde({key})]: ferry's payload \
                             format (postcard) cannot decode it; implement Schema by hand if the \
                             type is never sent"
                        )));
                    }
                    "with" | "serialize_with" | "deserialize_with" | "from" | "into"
                    | "try_from" | "getter" => {
                        out.needs_as = Some((key.clone(), meta.path.span()));
                        skip_value(&meta)?;
                    }
                    _ => skip_value(&meta)?,
                }
                Ok(())
            })?;
        } else if attr.path().is_ident("schema") {
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("as") {
                    out.as_type = Some(meta.value()?.parse()?);
                    Ok(())
                } else if meta.path.is_ident("crate") {
                    let value = meta.value()?;
                    out.krate = Some(if value.peek(LitStr) {
                        value.parse::<LitStr>()?.parse()?
                    } else {
                        value.parse()?
                    });
                    Ok(())
                } else {
                    Err(meta.error("expected `as = Type` or `crate = path`"))
                }
            })?;
        }
    }
    if out.as_type.is_none() {
        if let Some((key, span)) = &out.needs_as {
            return Err(syn::Error::new(
                *span,
                format!(
                    "#[serde({key})] changes what serde writes: add #[schema(as = Type)] naming \
                     the type it writes"
                ),
            ));
        }
    }
    Ok(out)
}

/// The serialize-side name of `rename = ".."` or `rename(serialize = "..")`
/// (what the sender writes); `None` for `rename(deserialize = "..")` alone,
/// which leaves the written name as it was.
fn serialize_name(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<Option<String>> {
    if meta.input.peek(syn::Token![=]) {
        return Ok(Some(meta.value()?.parse::<LitStr>()?.value()));
    }
    let mut name = None;
    meta.parse_nested_meta(|inner| {
        let value = inner.value()?.parse::<LitStr>()?.value();
        if inner.path.is_ident("serialize") {
            name = Some(value);
        } else if !inner.path.is_ident("deserialize") {
            return Err(inner.error("expected `serialize` or `deserialize`"));
        }
        Ok(())
    })?;
    Ok(name)
}

/// Consumes an attribute's value (`= expr` or `(..)`) without reading it.
fn skip_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        meta.value()?.parse::<syn::Expr>()?;
    } else if meta.input.peek(syn::token::Paren) {
        let content;
        syn::parenthesized!(content in meta.input);
        content.parse::<Tokens>()?;
    }
    Ok(())
}

/// How the types in a derived shape name the type being derived.
///
/// A struct or enum without generic parameters gets its shape from a
/// static (`Shape::Declared`), so that it may contain itself: the static
/// cannot name `Self`, which becomes the type's name. A generic type
/// cannot have a static (there is one shape per instantiation); where it
/// contains itself (`Self`, or its own name with its own parameters:
/// `Tree<T>` in `struct Tree<T>`), a marker type stands for it, whose
/// shape is `Shape::Recursive(name)`.
struct SelfTypes {
    ident: syn::Ident,
    /// For a generic type: its own parameters as written (`<T>`) and the
    /// marker type.
    generic: Option<(String, syn::Ident)>,
    /// Whether the marker replaced anything.
    used: bool,
}

impl SelfTypes {
    fn new(input: &DeriveInput) -> Self {
        let generic = (!input.generics.params.is_empty()).then(|| {
            let (_, ty_generics, _) = input.generics.split_for_impl();
            (
                ty_generics.to_token_stream().to_string(),
                syn::Ident::new("__FerrySchemaSelf", proc_macro2::Span::call_site()),
            )
        });
        Self {
            ident: input.ident.clone(),
            generic,
            used: false,
        }
    }

    /// `ty` as it is written where the shape is built.
    fn rewrite(&mut self, ty: &syn::Type) -> syn::Type {
        let mut ty = ty.clone();
        self.visit_type_mut(&mut ty);
        ty
    }

    /// Whether `ty` is the generic type itself: `Self`, or its name with its
    /// own parameters.
    fn is_self(&self, ty: &syn::Type, params: &str) -> bool {
        let syn::Type::Path(p) = ty else {
            return false;
        };
        if p.qself.is_some() || p.path.leading_colon.is_some() || p.path.segments.len() != 1 {
            return false;
        }
        let segment = &p.path.segments[0];
        (segment.ident == "Self" && segment.arguments.is_none())
            || (segment.ident == self.ident
                && segment.arguments.to_token_stream().to_string() == params)
    }
}

impl VisitMut for SelfTypes {
    fn visit_type_mut(&mut self, ty: &mut syn::Type) {
        if let Some((params, marker)) = &self.generic {
            if self.is_self(ty, params) {
                *ty = syn::parse_quote_spanned!(ty.span() => #marker);
                self.used = true;
                return;
            }
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }

    fn visit_path_mut(&mut self, path: &mut syn::Path) {
        if self.generic.is_none() && path.leading_colon.is_none() {
            if let Some(first) = path.segments.first_mut() {
                if first.ident == "Self" {
                    let mut ident = self.ident.clone();
                    ident.set_span(first.ident.span());
                    first.ident = ident;
                }
            }
        }
        syn::visit_mut::visit_path_mut(self, path);
    }
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let attrs = parse_attrs(&input.attrs)?;
    let krate: Tokens = match &attrs.krate {
        Some(path) => path.to_token_stream(),
        None => default_crate(),
    };
    let s = quote!(#krate::schema);
    let name = attrs.rename.clone().unwrap_or_else(|| unraw(&input.ident));
    // A named shape (not `transparent`, not `as`) may contain the type itself.
    let named = attrs.as_type.is_none() && !attrs.transparent;
    let mut selves = SelfTypes::new(input);
    let shape = if let Some(t) = &attrs.as_type {
        quote!(<#t as #s::Schema>::SHAPE)
    } else {
        match &input.data {
            Data::Struct(data) => {
                if attrs.transparent {
                    transparent(&data.fields, &s)?
                } else {
                    let body =
                        fields_shape(&data.fields, attrs.rename_all.as_deref(), &s, &mut selves)?;
                    match body {
                        FieldsShape::Unit => quote!(#s::Shape::UnitStruct(#name)),
                        FieldsShape::Newtype(inner) => {
                            quote!(#s::Shape::NewtypeStruct { name: #name, inner: #inner })
                        }
                        FieldsShape::Tuple(items) => {
                            quote!(#s::Shape::TupleStruct { name: #name, fields: &[#(#items),*] })
                        }
                        FieldsShape::Named(fields) => {
                            quote!(#s::Shape::Struct { name: #name, fields: &[#(#fields),*] })
                        }
                    }
                }
            }
            Data::Enum(data) => {
                let mut variants = Vec::new();
                for (index, v) in data.variants.iter().enumerate() {
                    let vattrs = parse_attrs(&v.attrs)?;
                    if vattrs.skip {
                        continue;
                    }
                    let index = index as u32;
                    let vname = vattrs.rename.clone().unwrap_or_else(|| {
                        rename(&unraw(&v.ident), attrs.rename_all.as_deref(), Case::Variant)
                    });
                    let field_rule = vattrs
                        .rename_all
                        .as_deref()
                        .or(attrs.rename_all_fields.as_deref());
                    let data = if let Some(t) = &vattrs.as_type {
                        let t = selves.rewrite(t);
                        quote!(#s::VariantData::Newtype(<#t as #s::Schema>::SHAPE))
                    } else {
                        match fields_shape(&v.fields, field_rule, &s, &mut selves)? {
                            FieldsShape::Unit => quote!(#s::VariantData::Unit),
                            FieldsShape::Newtype(inner) => quote!(#s::VariantData::Newtype(#inner)),
                            FieldsShape::Tuple(items) => {
                                quote!(#s::VariantData::Tuple(&[#(#items),*]))
                            }
                            FieldsShape::Named(fields) => {
                                quote!(#s::VariantData::Struct(&[#(#fields),*]))
                            }
                        }
                    };
                    variants.push(quote!(#s::Variant { index: #index, name: #vname, data: #data }));
                }
                quote!(#s::Shape::Enum { name: #name, variants: &[#(#variants),*] })
            }
            Data::Union(u) => {
                return Err(syn::Error::new(
                    u.union_token.span(),
                    "#[derive(Schema)] does not support unions",
                ))
            }
        }
    };

    let mut generics = input.generics.clone();
    let params: Vec<syn::Ident> = generics
        .params
        .iter()
        .filter_map(|p| match p {
            GenericParam::Type(t) => Some(t.ident.clone()),
            _ => None,
        })
        .collect();
    {
        let where_clause = generics.make_where_clause();
        for p in params {
            where_clause
                .predicates
                .push(syn::parse_quote!(#p: #s::Schema));
        }
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let ident = &input.ident;
    let value = match &selves.generic {
        // In a static, under the declaration's identity: what lets the type
        // contain itself, directly or through other types.
        None if named => {
            let type_name = unraw(ident);
            quote!({
                static __FERRY_SCHEMA_SHAPE: #s::Shape = #shape;
                &#s::Shape::Declared(#s::Declaration::new(
                    ::core::concat!(::core::module_path!(), "::", #type_name),
                    &__FERRY_SCHEMA_SHAPE,
                ))
            })
        }
        Some((_, marker)) if named && selves.used => quote!({
            #[allow(dead_code)]
            struct #marker;
            #[automatically_derived]
            impl #s::Schema for #marker {
                const SHAPE: &'static #s::Shape = &#s::Shape::Recursive(#name);
            }
            &#shape
        }),
        _ => quote!(&#shape),
    };
    Ok(quote! {
        #[automatically_derived]
        impl #impl_generics #s::Schema for #ident #ty_generics #where_clause {
            const SHAPE: &'static #s::Shape = #value;
        }
    })
}

enum FieldsShape {
    Unit,
    Newtype(Tokens),
    Tuple(Vec<Tokens>),
    Named(Vec<Tokens>),
}

/// The shape of one field's type, or of its `#[schema(as = T)]`.
fn field_type_shape(
    field: &syn::Field,
    attrs: &Attrs,
    s: &Tokens,
    selves: &mut SelfTypes,
) -> Tokens {
    let ty = selves.rewrite(attrs.as_type.as_ref().unwrap_or(&field.ty));
    quote!(<#ty as #s::Schema>::SHAPE)
}

fn fields_shape(
    fields: &Fields,
    rule: Option<&str>,
    s: &Tokens,
    selves: &mut SelfTypes,
) -> syn::Result<FieldsShape> {
    Ok(match fields {
        Fields::Unit => FieldsShape::Unit,
        Fields::Unnamed(unnamed) => {
            let mut items = Vec::new();
            for f in &unnamed.unnamed {
                let a = parse_attrs(&f.attrs)?;
                if !a.skip {
                    items.push(field_type_shape(f, &a, s, selves));
                }
            }
            // serde writes a tuple struct of one field (as declared) as a newtype.
            if unnamed.unnamed.len() == 1 && items.len() == 1 {
                FieldsShape::Newtype(items.remove(0))
            } else {
                FieldsShape::Tuple(items)
            }
        }
        Fields::Named(named) => {
            let mut items = Vec::new();
            for f in &named.named {
                let a = parse_attrs(&f.attrs)?;
                if a.skip {
                    continue;
                }
                let ident = f.ident.as_ref().map(unraw).unwrap_or_default();
                let name = a
                    .rename
                    .clone()
                    .unwrap_or_else(|| rename(&ident, rule, Case::Field));
                let shape = field_type_shape(f, &a, s, selves);
                items.push(quote!(#s::Field { name: #name, shape: #shape }));
            }
            FieldsShape::Named(items)
        }
    })
}

/// `#[serde(transparent)]`: the shape of the one field not skipped.
fn transparent(fields: &Fields, s: &Tokens) -> syn::Result<Tokens> {
    let mut kept = Vec::new();
    for f in fields.iter() {
        let a = parse_attrs(&f.attrs)?;
        if !a.skip {
            let ty = a.as_type.as_ref().unwrap_or(&f.ty);
            kept.push(quote!(<#ty as #s::Schema>::SHAPE));
        }
    }
    match kept.len() {
        1 => Ok(kept.remove(0)),
        _ => Err(syn::Error::new(
            fields.span(),
            "#[serde(transparent)] needs exactly one field that is not skipped",
        )),
    }
}

/// The path of `ferry_rpc` from the crate being compiled: its own name in
/// the crate's dependencies, or the facade's `ferry::rpc`.
fn default_crate() -> Tokens {
    use proc_macro_crate::{crate_name, FoundCrate};
    match crate_name("ferry-rpc") {
        // ferry-rpc itself (which names itself `ferry_rpc`), its tests and examples.
        Ok(FoundCrate::Itself) => quote!(::ferry_rpc),
        Ok(FoundCrate::Name(name)) => {
            let name = syn::Ident::new(&name, proc_macro2::Span::call_site());
            quote!(::#name)
        }
        Err(_) => match crate_name("ferry") {
            Ok(FoundCrate::Itself) => quote!(crate::rpc),
            Ok(FoundCrate::Name(name)) => {
                let name = syn::Ident::new(&name, proc_macro2::Span::call_site());
                quote!(::#name::rpc)
            }
            Err(_) => quote!(::ferry_rpc),
        },
    }
}

fn unraw(ident: &syn::Ident) -> String {
    let s = ident.to_string();
    s.strip_prefix("r#").map(str::to_string).unwrap_or(s)
}

#[derive(Clone, Copy)]
enum Case {
    /// A variant name, written in PascalCase.
    Variant,
    /// A field name, written in snake_case.
    Field,
}

/// serde's `rename_all` rules applied to a name declared in `case`.
fn rename(name: &str, rule: Option<&str>, case: Case) -> String {
    let Some(rule) = rule else {
        return name.to_string();
    };
    // Bring the name to snake_case first, then apply the rule.
    let snake = match case {
        Case::Field => name.to_string(),
        Case::Variant => {
            let mut out = String::new();
            for (i, c) in name.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    out.push('_');
                }
                out.extend(c.to_lowercase());
            }
            out
        }
    };
    let pascal = || {
        let mut out = String::new();
        let mut upper = true;
        for c in snake.chars() {
            if c == '_' {
                upper = true;
            } else if upper {
                out.extend(c.to_uppercase());
                upper = false;
            } else {
                out.push(c);
            }
        }
        out
    };
    match rule {
        "lowercase" => match case {
            Case::Variant => name.to_lowercase(),
            Case::Field => name.to_string(),
        },
        "UPPERCASE" => name.to_uppercase(),
        "PascalCase" => match case {
            Case::Variant => name.to_string(),
            Case::Field => pascal(),
        },
        "camelCase" => {
            let p = match case {
                Case::Variant => name.to_string(),
                Case::Field => pascal(),
            };
            let mut chars = p.chars();
            match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => p,
            }
        }
        "snake_case" => snake,
        "SCREAMING_SNAKE_CASE" => snake.to_uppercase(),
        "kebab-case" => snake.replace('_', "-"),
        "SCREAMING-KEBAB-CASE" => snake.to_uppercase().replace('_', "-"),
        _ => name.to_string(),
    }
}

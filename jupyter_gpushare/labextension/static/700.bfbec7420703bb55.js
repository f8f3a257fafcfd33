"use strict";(self.rspackChunkjupyter_gpushare=self.rspackChunkjupyter_gpushare||[]).push([[700],{646(r,e,o){var a=o(601),p=o.n(a),t=o(933),s=(o.n(t))()(p());s.push([r.id,`/* jupyter-gpushare: the GPU share picker, start progress, status-bar item and GPU dashboard.
   JupyterLab's CSS variables only, so the light and dark themes both work; text uses
   --jp-ui-font-color1/--jp-content-font-color1 on --jp-layout-color* backgrounds (tests/lab
   asserts a WCAG AA contrast of at least 4.5:1 for every text in both themes). */

.jp-gpushare-picker {
  min-width: 460px;
  max-width: 640px;
  font-size: var(--jp-ui-font-size1);
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-simulated {
  color: var(--jp-ui-font-color1);
  border-left: 3px solid var(--jp-warn-color1);
  padding-left: 8px;
}

/* a refusal: the theme's text colour on its raised background, marked by the error colour */
.jp-gpushare-problem {
  border-left: 4px solid var(--jp-error-color1);
  background: var(--jp-layout-color2);
  color: var(--jp-ui-font-color1);
  padding: 4px 8px;
  margin: 8px 0;
}

.jp-gpushare-problem-message {
  margin: 0;
  white-space: pre-wrap;
}

.jp-gpushare-suggestions {
  margin: 4px 0 0;
  padding-left: 20px;
}

.jp-gpushare-types {
  border-collapse: collapse;
  width: 100%;
  margin: 8px 0;
}

.jp-gpushare-types th,
.jp-gpushare-types td {
  border-bottom: 1px solid var(--jp-border-color2);
  padding: 2px 6px;
  text-align: left;
}

.jp-gpushare-types tbody tr {
  cursor: pointer;
}

.jp-gpushare-types tbody tr:hover {
  background: var(--jp-layout-color2);
}

.jp-gpushare-presets {
  display: flex;
  gap: 6px;
  align-items: center;
  margin: 8px 0;
}

.jp-gpushare-fields {
  display: grid;
  grid-template-columns: 1fr 1fr;
  gap: 6px 12px;
}

.jp-gpushare-fields label {
  display: flex;
  flex-direction: column;
  gap: 2px;
}

.jp-gpushare-fields label.jp-gpushare-invalid input,
.jp-gpushare-fields label.jp-gpushare-invalid select {
  outline: 2px solid var(--jp-error-color1);
}

.jp-gpushare-status {
  padding: 0 6px;
  line-height: 24px;
  white-space: nowrap;
}

.jp-gpushare-preset {
  background: var(--jp-layout-color2);
  color: var(--jp-ui-font-color1);
  border: 1px solid var(--jp-border-color1);
  padding: 2px 10px;
  cursor: pointer;
}

.jp-gpushare-preset:hover {
  background: var(--jp-layout-color3);
}

/* Lab caps dialogs at 500px; the picker needs room for the explanation, table and fields. */
.jp-Dialog-content:has(.jp-gpushare-picker) {
  max-height: 90vh;
}

.jp-gpushare-types,
.jp-gpushare-fields label,
.jp-gpushare-presets {
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-status {
  cursor: pointer;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-status:focus-visible {
  outline: 2px solid var(--jp-brand-color1);
}

/* start progress */
.jp-gpushare-progress {
  min-width: 360px;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-progress ol {
  list-style: none;
  padding-left: 0;
}

.jp-gpushare-phase.jp-mod-now {
  font-weight: bold;
}

.jp-gpushare-progress-detail {
  white-space: pre-wrap;
  border-left: 3px solid var(--jp-brand-color1);
  padding-left: 8px;
}

/* waiting in line (queue.ts) */
.jp-gpushare-wait-offer {
  display: block;
  margin-top: 4px;
}

.jp-gpushare-waiting {
  min-width: 360px;
  max-width: 560px;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-waiting-line {
  white-space: pre-wrap;
  border-left: 3px solid var(--jp-warn-color1);
  padding-left: 8px;
  font-weight: bold;
}

.jp-gpushare-waiting-line[data-state='starting'] {
  border-left-color: var(--jp-success-color1);
}

/* the GPU dashboard (side panel) */
.jp-gpushare-dashboard {
  background: var(--jp-layout-color1);
  color: var(--jp-ui-font-color1);
  font-size: var(--jp-ui-font-size1);
  padding: 8px 12px;
  overflow-y: auto;
  min-width: 260px;
}

.jp-gpushare-dashboard:focus-visible,
.jp-gpushare-dashboard button:focus-visible {
  outline: 2px solid var(--jp-brand-color1);
}

.jp-gpushare-dashboard h2 {
  font-size: var(--jp-ui-font-size3);
  margin: 4px 0 8px;
}

.jp-gpushare-dashboard h3 {
  font-size: var(--jp-ui-font-size2);
  margin: 16px 0 4px;
  border-bottom: 1px solid var(--jp-border-color2);
}

.jp-gpushare-dashboard h4 {
  margin: 12px 0 2px;
  font-size: var(--jp-ui-font-size1);
}

.jp-gpushare-note,
.jp-gpushare-gpu-summary {
  margin: 2px 0 6px;
}

.jp-gpushare-facts {
  display: grid;
  grid-template-columns: max-content 1fr;
  gap: 2px 12px;
  margin: 4px 0;
}

.jp-gpushare-facts dt {
  font-weight: bold;
}

.jp-gpushare-facts dd {
  margin: 0;
}

.jp-gpushare-actions {
  display: flex;
  gap: 8px;
  flex-wrap: wrap;
  margin: 6px 0;
}

.jp-gpushare-button {
  background: var(--jp-layout-color2);
  color: var(--jp-ui-font-color1);
  border: 1px solid var(--jp-border-color1);
  padding: 2px 10px;
  cursor: pointer;
}

.jp-gpushare-button:hover {
  background: var(--jp-layout-color3);
}

.jp-gpushare-chart {
  margin: 6px 0;
}

.jp-gpushare-chart-title {
  font-weight: bold;
}

.jp-gpushare-chart svg {
  display: block;
  max-width: 420px;
}

.jp-gpushare-plot-area {
  fill: var(--jp-layout-color1);
  stroke: none;
}

.jp-gpushare-grid {
  stroke: var(--jp-border-color2);
  stroke-width: 1;
}

.jp-gpushare-axis {
  stroke: var(--jp-ui-font-color1);
  stroke-width: 1;
}

.jp-gpushare-axis-label {
  fill: var(--jp-ui-font-color1);
  font-size: 10px;
  font-family: var(--jp-ui-font-family);
}

.jp-gpushare-line {
  fill: none;
  stroke-width: 2;
}

/* request and limit: the notebook panel's styles (notebook/panel.py, SERIES), one legend for
   both; reserved (a GPU's) longer dashes, drawn over the use */
.jp-gpushare-rule {
  stroke-width: 1.5;
  stroke-dasharray: 8 3;
}

.jp-gpushare-line.jp-mod-mine,
.jp-gpushare-line.jp-mod-total {
  stroke: var(--jp-brand-color1);
}

.jp-gpushare-rule.jp-mod-request {
  stroke: var(--jp-info-color1, #0097a7);
  stroke-dasharray: 6 3;
}

.jp-gpushare-rule.jp-mod-reserved {
  stroke: var(--jp-warn-color1);
  stroke-width: 2;
}

.jp-gpushare-rule.jp-mod-limit {
  stroke: var(--jp-error-color1, #d32f2f);
  stroke-dasharray: 2 3;
}

.jp-gpushare-legend {
  display: flex;
  flex-wrap: wrap;
  gap: 4px 12px;
  margin-top: 2px;
}

.jp-gpushare-legend-item {
  display: inline-flex;
  align-items: center;
  gap: 4px;
}

.jp-gpushare-swatch {
  display: inline-block;
  flex: none;
}

.jp-gpushare-swatch line {
  stroke-width: 2;
}

.jp-gpushare-capacity {
  display: flex;
  height: 10px;
  border: 1px solid var(--jp-border-color1);
  background: var(--jp-layout-color2);
  margin: 4px 0;
  max-width: 420px;
}

.jp-gpushare-capacity-part {
  height: 100%;
  border-right: 1px solid var(--jp-layout-color1);
}

.jp-gpushare-capacity-part.jp-mod-mine {
  background: var(--jp-brand-color1);
}

.jp-gpushare-capacity-part.jp-mod-other {
  background: var(--jp-ui-font-color2);
}

.jp-gpushare-shares {
  border-collapse: collapse;
  table-layout: fixed;
  width: 100%;
  margin: 4px 0 8px;
}

.jp-gpushare-shares th:first-child {
  width: 50%;
}

.jp-gpushare-shares caption {
  text-align: left;
  font-weight: bold;
  padding: 2px 0;
}

.jp-gpushare-shares th,
.jp-gpushare-shares td {
  text-align: left;
  padding: 2px 6px;
  border-bottom: 1px solid var(--jp-border-color2);
  overflow-wrap: break-word;
  hyphens: none;
}

/* a notebook path or command: one line, cut with an ellipsis (the whole in its tooltip) */
.jp-gpushare-what {
  white-space: nowrap;
  overflow: hidden;
  text-overflow: ellipsis;
}

/* the main area: the GPUs side by side */
.jp-gpushare-dashboard.jp-mod-wide .jp-gpushare-gpus {
  display: grid;
  grid-template-columns: repeat(auto-fill, minmax(380px, 1fr));
  gap: 0 24px;
}

.jp-gpushare-dashboard.jp-mod-wide .jp-gpushare-gpus > h3,
.jp-gpushare-dashboard.jp-mod-wide .jp-gpushare-gpus > p {
  grid-column: 1 / -1;
}

.jp-gpushare-shares td {
  vertical-align: top;
}

.jp-gpushare-whose {
  font-weight: bold;
}

.jp-gpushare-shares tr.jp-mod-mine td:first-child {
  border-left: 3px solid var(--jp-brand-color1);
}

/* the picker's live checks: each field keeps room for its message, and the fit and summary lines
   keep theirs, so the dialog does not move while the user types */
.jp-gpushare-field-row {
  display: flex;
  align-items: center;
  gap: 6px;
}

.jp-gpushare-field-row input,
.jp-gpushare-field-row select {
  flex: 1;
  min-width: 0;
}

.jp-gpushare-percent {
  min-width: 4.5em;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-field-error {
  display: block;
  height: 3.9em;
  overflow: hidden;
  font-size: var(--jp-ui-font-size0);
  line-height: 1.3em;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-fields label.jp-gpushare-invalid .jp-gpushare-field-error {
  border-left: 3px solid var(--jp-error-color1);
  padding-left: 4px;
}

.jp-gpushare-summary {
  margin: 6px 0 2px;
  min-height: 1.4em;
  font-weight: bold;
}

.jp-gpushare-fit {
  min-height: 3.8em;
  padding: 2px 8px;
  border-left: 4px solid var(--jp-border-color2);
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-fit[data-fits='yes'] {
  border-left-color: var(--jp-success-color1);
}

.jp-gpushare-fit[data-fits='no'] {
  border-left-color: var(--jp-warn-color1);
  background: var(--jp-layout-color2);
}

/* "Use": a button, not text */
button.jp-gpushare-use {
  display: inline-block;
  margin: 2px 0;
  padding: 2px 10px;
  border: 1px solid var(--jp-brand-color1);
  border-radius: 2px;
  background: var(--jp-layout-color1);
  color: var(--jp-ui-font-color1);
  font-weight: bold;
  cursor: pointer;
}

button.jp-gpushare-use:hover {
  background: var(--jp-layout-color3);
}

.jp-gpushare-restart-warning {
  border-left: 4px solid var(--jp-warn-color1);
  padding-left: 8px;
  color: var(--jp-ui-font-color1);
}

.jp-gpushare-live-note {
  min-height: 2.8em;
  margin: 4px 0 0;
}
`,""]),o.d(e,{},{A:s})},933(r){r.exports=function(r){var e=[];return e.toString=function(){return this.map(function(e){var o="",a=void 0!==e[5];return e[4]&&(o+="@supports (".concat(e[4],") {")),e[2]&&(o+="@media ".concat(e[2]," {")),a&&(o+="@layer".concat(e[5].length>0?" ".concat(e[5]):""," {")),o+=r(e),a&&(o+="}"),e[2]&&(o+="}"),e[4]&&(o+="}"),o}).join("")},e.i=function(r,o,a,p,t){"string"==typeof r&&(r=[[null,r,void 0]]);var s={};if(a)for(var i=0;i<this.length;i++){var n=this[i][0];null!=n&&(s[n]=!0)}for(var l=0;l<r.length;l++){var d=[].concat(r[l]);a&&s[d[0]]||(void 0!==t&&(void 0===d[5]||(d[1]="@layer".concat(d[5].length>0?" ".concat(d[5]):""," {").concat(d[1],"}")),d[5]=t),o&&(d[2]&&(d[1]="@media ".concat(d[2]," {").concat(d[1],"}")),d[2]=o),p&&(d[4]?(d[1]="@supports (".concat(d[4],") {").concat(d[1],"}"),d[4]=p):d[4]="".concat(p)),e.push(d))}},e}},601(r){r.exports=function(r){return r[1]}},72(r){var e=[];function o(r){for(var o=-1,a=0;a<e.length;a++)if(e[a].identifier===r){o=a;break}return o}function a(r,a){for(var p={},t=[],s=0;s<r.length;s++){var i=r[s],n=a.base?i[0]+a.base:i[0],l=p[n]||0,d="".concat(n," ").concat(l);p[n]=l+1;var u=o(d),h={css:i[1],media:i[2],sourceMap:i[3],supports:i[4],layer:i[5]};if(-1!==u)e[u].references++,e[u].updater(h);else{var c=function(r,e){var o=e.domAPI(e);return o.update(r),function(e){e?(e.css!==r.css||e.media!==r.media||e.sourceMap!==r.sourceMap||e.supports!==r.supports||e.layer!==r.layer)&&o.update(r=e):o.remove()}}(h,a);a.byIndex=s,e.splice(s,0,{identifier:d,updater:c,references:1})}t.push(d)}return t}r.exports=function(r,p){var t=a(r=r||[],p=p||{});return function(r){r=r||[];for(var s=0;s<t.length;s++){var i=o(t[s]);e[i].references--}for(var n=a(r,p),l=0;l<t.length;l++){var d=o(t[l]);0===e[d].references&&(e[d].updater(),e.splice(d,1))}t=n}}},659(r){var e={};r.exports=function(r,o){var a=function(r){if(void 0===e[r]){var o=document.querySelector(r);if(window.HTMLIFrameElement&&o instanceof window.HTMLIFrameElement)try{o=o.contentDocument.head}catch(r){o=null}e[r]=o}return e[r]}(r);if(!a)throw Error("Couldn't find a style target. This probably means that the value for the 'insert' parameter is invalid.");a.appendChild(o)}},540(r){r.exports=function(r){var e=document.createElement("style");return r.setAttributes(e,r.attributes),r.insert(e,r.options),e}},56(r,e,o){r.exports=function(r){var e=o.nc;e&&r.setAttribute("nonce",e)}},206(r){r.exports=function(r){if("u"<typeof document)return{update:function(){},remove:function(){}};var e=r.insertStyleElement(r);return{update:function(o){var a,p,t;a="",o.supports&&(a+="@supports (".concat(o.supports,") {")),o.media&&(a+="@media ".concat(o.media," {")),(p=void 0!==o.layer)&&(a+="@layer".concat(o.layer.length>0?" ".concat(o.layer):""," {")),a+=o.css,p&&(a+="}"),o.media&&(a+="}"),o.supports&&(a+="}"),(t=o.sourceMap)&&"u">typeof btoa&&(a+="\n/*# sourceMappingURL=data:application/json;base64,".concat(btoa(unescape(encodeURIComponent(JSON.stringify(t))))," */")),r.styleTagTransform(a,e,r.options)},remove:function(){var r;null===(r=e).parentNode||r.parentNode.removeChild(r)}}}},113(r){r.exports=function(r,e){if(e.styleSheet)e.styleSheet.cssText=r;else{for(;e.firstChild;)e.removeChild(e.firstChild);e.appendChild(document.createTextNode(r))}}},959(r,e,o){var a=o(72),p=o.n(a),t=o(206),s=o.n(t),i=o(659),n=o.n(i),l=o(56),d=o.n(l),u=o(540),h=o.n(u),c=o(113),g=o.n(c),j=o(646),f={};f.styleTagTransform=g(),f.setAttributes=d(),f.insert=n().bind(null,"head"),f.domAPI=s(),f.insertStyleElement=h(),p()(j.A,f),j.A&&j.A.locals&&j.A.locals}}]);
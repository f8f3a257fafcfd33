"use strict";(self.rspackChunkjupyter_gpushare=self.rspackChunkjupyter_gpushare||[]).push([[700],{646(r,e,a){var o=a(601),p=a.n(o),t=a(933),s=(a.n(t))()(p());s.push([r.id,`/* jupyter-gpushare: the GPU share picker, start progress, status-bar item and GPU dashboard.
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

.jp-gpushare-rule {
  stroke-width: 1.5;
  stroke-dasharray: 5 3;
}

.jp-gpushare-line.jp-mod-mine,
.jp-gpushare-line.jp-mod-total {
  stroke: var(--jp-brand-color1);
}

.jp-gpushare-rule.jp-mod-request,
.jp-gpushare-rule.jp-mod-reserved {
  stroke: var(--jp-warn-color1);
}

.jp-gpushare-rule.jp-mod-limit {
  stroke: var(--jp-error-color1);
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
  width: 16px;
  height: 0;
  border-top: 2px solid var(--jp-brand-color1);
}

.jp-gpushare-swatch.jp-mod-request,
.jp-gpushare-swatch.jp-mod-reserved {
  border-top: 2px dashed var(--jp-warn-color1);
}

.jp-gpushare-swatch.jp-mod-limit {
  border-top: 2px dashed var(--jp-error-color1);
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
  width: 100%;
  margin: 4px 0 8px;
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
  overflow-wrap: anywhere;
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
`,""]),a.d(e,{},{A:s})},933(r){r.exports=function(r){var e=[];return e.toString=function(){return this.map(function(e){var a="",o=void 0!==e[5];return e[4]&&(a+="@supports (".concat(e[4],") {")),e[2]&&(a+="@media ".concat(e[2]," {")),o&&(a+="@layer".concat(e[5].length>0?" ".concat(e[5]):""," {")),a+=r(e),o&&(a+="}"),e[2]&&(a+="}"),e[4]&&(a+="}"),a}).join("")},e.i=function(r,a,o,p,t){"string"==typeof r&&(r=[[null,r,void 0]]);var s={};if(o)for(var n=0;n<this.length;n++){var i=this[n][0];null!=i&&(s[i]=!0)}for(var l=0;l<r.length;l++){var u=[].concat(r[l]);o&&s[u[0]]||(void 0!==t&&(void 0===u[5]||(u[1]="@layer".concat(u[5].length>0?" ".concat(u[5]):""," {").concat(u[1],"}")),u[5]=t),a&&(u[2]&&(u[1]="@media ".concat(u[2]," {").concat(u[1],"}")),u[2]=a),p&&(u[4]?(u[1]="@supports (".concat(u[4],") {").concat(u[1],"}"),u[4]=p):u[4]="".concat(p)),e.push(u))}},e}},601(r){r.exports=function(r){return r[1]}},72(r){var e=[];function a(r){for(var a=-1,o=0;o<e.length;o++)if(e[o].identifier===r){a=o;break}return a}function o(r,o){for(var p={},t=[],s=0;s<r.length;s++){var n=r[s],i=o.base?n[0]+o.base:n[0],l=p[i]||0,u="".concat(i," ").concat(l);p[i]=l+1;var d=a(u),c={css:n[1],media:n[2],sourceMap:n[3],supports:n[4],layer:n[5]};if(-1!==d)e[d].references++,e[d].updater(c);else{var h=function(r,e){var a=e.domAPI(e);return a.update(r),function(e){e?(e.css!==r.css||e.media!==r.media||e.sourceMap!==r.sourceMap||e.supports!==r.supports||e.layer!==r.layer)&&a.update(r=e):a.remove()}}(c,o);o.byIndex=s,e.splice(s,0,{identifier:u,updater:h,references:1})}t.push(u)}return t}r.exports=function(r,p){var t=o(r=r||[],p=p||{});return function(r){r=r||[];for(var s=0;s<t.length;s++){var n=a(t[s]);e[n].references--}for(var i=o(r,p),l=0;l<t.length;l++){var u=a(t[l]);0===e[u].references&&(e[u].updater(),e.splice(u,1))}t=i}}},659(r){var e={};r.exports=function(r,a){var o=function(r){if(void 0===e[r]){var a=document.querySelector(r);if(window.HTMLIFrameElement&&a instanceof window.HTMLIFrameElement)try{a=a.contentDocument.head}catch(r){a=null}e[r]=a}return e[r]}(r);if(!o)throw Error("Couldn't find a style target. This probably means that the value for the 'insert' parameter is invalid.");o.appendChild(a)}},540(r){r.exports=function(r){var e=document.createElement("style");return r.setAttributes(e,r.attributes),r.insert(e,r.options),e}},56(r,e,a){r.exports=function(r){var e=a.nc;e&&r.setAttribute("nonce",e)}},206(r){r.exports=function(r){if("u"<typeof document)return{update:function(){},remove:function(){}};var e=r.insertStyleElement(r);return{update:function(a){var o,p,t;o="",a.supports&&(o+="@supports (".concat(a.supports,") {")),a.media&&(o+="@media ".concat(a.media," {")),(p=void 0!==a.layer)&&(o+="@layer".concat(a.layer.length>0?" ".concat(a.layer):""," {")),o+=a.css,p&&(o+="}"),a.media&&(o+="}"),a.supports&&(o+="}"),(t=a.sourceMap)&&"u">typeof btoa&&(o+="\n/*# sourceMappingURL=data:application/json;base64,".concat(btoa(unescape(encodeURIComponent(JSON.stringify(t))))," */")),r.styleTagTransform(o,e,r.options)},remove:function(){var r;null===(r=e).parentNode||r.parentNode.removeChild(r)}}}},113(r){r.exports=function(r,e){if(e.styleSheet)e.styleSheet.cssText=r;else{for(;e.firstChild;)e.removeChild(e.firstChild);e.appendChild(document.createTextNode(r))}}},959(r,e,a){var o=a(72),p=a.n(o),t=a(206),s=a.n(t),n=a(659),i=a.n(n),l=a(56),u=a.n(l),d=a(540),c=a.n(d),h=a(113),g=a.n(h),j=a(646),f={};f.styleTagTransform=g(),f.setAttributes=u(),f.insert=i().bind(null,"head"),f.domAPI=s(),f.insertStyleElement=c(),p()(j.A,f),j.A&&j.A.locals&&j.A.locals}}]);